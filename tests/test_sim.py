"""`kvhandoff simulate`: its costs are fitted on a real bench run and reproduce that run's per-phase
medians; the fleet model is deterministic under a seed and routes as the router does."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from kvhandoff.router import policies
from kvhandoff.router.policies import DecodePolicy
from kvhandoff.sim.calibrate import Costs, Linear, computed_tokens, link_of
from kvhandoff.sim.fleet import LATE_BINDING_MARGIN, POLICIES, Fleet, Job, Link, RouterCosts, Routing, poisson_jobs


def costs(**changes) -> Costs:
    """Two decode workers, the second ten times slower per step; 10 ms prompts."""
    base = dict(label="synthetic", mode="push", prefill_ms=Linear(2.0, 0.01), transfer_ms=Linear(0.5, 1.0),
                step_ms={"fast": Linear(1.0, 0.1), "slow": Linear(10.0, 0.1)}, handoff_wait_ms=0.5, admission_ms=0.3,
                first_token_ms=[1.0, 1.5], second_token_ms={"fast": [2.0, 3.0], "slow": [12.0]},
                kv_bytes_per_token=2048.0,
                prefill_workers=["p"], decode_workers=["fast", "slow"], decode_policy="round-robin", poll_s=0.05,
                prompt_tokens=[100, 400, 800], output_tokens=[16, 32, 64])
    return Costs(**{**base, **changes})


def test_the_model_routes_by_the_routers_rules():
    """fleet.py spells out the router's policies and late-binding margin (importing the router would
    load its web stack into every `kvhandoff` command): kept equal here."""
    assert set(POLICIES) == {p.value for p in DecodePolicy}
    assert LATE_BINDING_MARGIN == policies.LATE_BINDING_MARGIN


def test_a_line_is_fitted_back():
    assert Linear.fit([1, 2, 3, 4], [3, 5, 7, 9]) == Linear(1.0, 2.0)
    assert Linear.fit([5, 5], [2.0, 4.0]) == Linear(3.0, 0.0)          # one size: its median, no slope


def test_the_model_is_deterministic_under_a_seed():
    def run(seed: int) -> list[dict]:
        return Fleet(costs(step_spread={"fast": [0.9, 1.1]}), 2, 6, "load", "late-bound", seed=seed).run(
            poisson_jobs(costs(), 40.0, 300, seed))
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_a_requests_way_in_and_its_first_tokens_way_out_are_drawn_together():
    """Each job's ingress and first-token delay come from one measured request: here they always add up
    to 10 ms (drawn apart, a fourth of the jobs would get 0 and a fourth 20)."""
    paired = costs(ingress_ms=[0.0, 10.0], first_token_ms=[10.0, 0.0])
    done = Fleet(paired, 1, 2, "load", "early", seed=3).run(poisson_jobs(paired, 5.0, 40, 3))
    ways = [d["ttft_ms"] - d["phases_ms"]["prefill_queue"] - d["phases_ms"]["prefill_compute"] for d in done]
    assert len(ways) == 40 and all(w == pytest.approx(10.0) for w in ways), ways


def test_policies_and_binding_as_the_router_routes():
    jobs = lambda: poisson_jobs(costs(), 20.0, 200, 1)
    blind = Fleet(costs(), 1, 2, "round-robin", "early").run(jobs())
    assert sum(d["decode_worker"] == 1 for d in blind) == 100                   # in turn, whatever the load
    aware = Fleet(costs(), 1, 2, "load", "early").run(jobs())
    assert sum(d["decode_worker"] == 1 for d in aware) < 40
    # Prompts that take longer than a poll: late binding moves what round-robin bound to the slow one.
    slow_prefill = costs(prefill_ms=Linear(200.0, 0.0))
    late = Fleet(slow_prefill, 4, 2, "round-robin", "late-bound").run(poisson_jobs(slow_prefill, 10.0, 100, 1))
    moved = [d for d in late if d["moved_from"] is not None]
    assert moved and all(d["moved_from"] == 1 and d["decode_worker"] == 0 for d in moved)
    for d in late:
        assert d["ttft_ms"] >= d["phases_ms"]["prefill_compute"] and d["tpot_ms"] > 0


def test_fitted_on_a_real_run_it_reproduces_its_medians(tmp_path):
    out = tmp_path / "run"
    try:
        bench = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "bench", "--model", "tiny", "--launch", "push",
                                "--launch-args", "--prefill 1 --decode 2 --dtype float32 --health-interval 0.2",
                                "--capacity", "8", "--rates", "1", "--requests", "40", "--output-tokens", "24",
                                "--out", str(out)], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as exc:      # what the stack was doing, to tell a hang from a slow machine
        stack_log = (out / "logs" / "push.log").read_text(errors="replace")[-4000:]
        pytest.fail(f"the bench did not finish in 180 s:\n{(exc.stderr or b'').decode()[-2000:]}\n{stack_log}")
    assert bench.returncode == 0, bench.stderr[-3000:]
    report = tmp_path / "sim.json"
    sim = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "simulate", "--calibrate", str(out),
                          "--prefill", "4", "--decode", "8", "--rates", "20", "--requests", "200",
                          "--json", str(report)], capture_output=True, text=True, timeout=120)
    assert sim.returncode == 0, sim.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got["costs"]["mode"] == "push" and len(got["costs"]["decode_workers"]) == 2
    for name, r in got["reproduction"].items():      # within 15%, or 1 ms for sub-millisecond phases
        assert r["within"], (name, r, sim.stdout)
    assert [p["requests"] for p in got["scaled"]] == [200]
    bad = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "simulate", "--calibrate", str(out),
                          "--policies", "fastest"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown or impossible policy 'fastest'" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "simulate", "--calibrate", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "not a kvhandoff bench output folder" in missing.stderr
    assert "Traceback" not in bad.stderr + missing.stderr


@pytest.mark.parametrize("rate", [5.0])
def test_every_job_finishes_with_its_tokens(rate):
    done = Fleet(costs(), 1, 2, "fewest-in-flight", "late").run(poisson_jobs(costs(), rate, 50, 3))
    assert len(done) == 50
    for d in done:
        assert d["tpot_ms"] is not None and d["phases_ms"]["prefill_queue"] >= 0 and d["decode_worker"] in (0, 1)


def test_behind_a_link_the_transfer_is_bytes_over_rate_and_layer_wise_push_hides_it():
    """One 1,000-token prompt at a time (20 ms to compute, 2 MB of KV): at 1 Gbit/s the KV takes 16.8 ms,
    under the prompt: pull pays it all after the prompt, layer-wise push only the last layer's share;
    at 100 Mbit/s (168 ms) layer-wise push is bound by the link, not the prompt."""
    fixed = costs(prefill_ms=Linear(0.0, 0.02), transfer_ms=Linear(0.5, 0.0),
                  prompt_tokens=[1000], output_tokens=[8])
    jobs = lambda: [Job(i, i * 1.0, 1000, 8) for i in range(4)]     # a second apart: nothing queues
    send_ms = lambda gbit: 1000 * 2048 * 8 / (gbit * 1e9) * 1e3
    pulls = {}
    for gbit in (1.0, 0.1):
        pull = pulls[gbit] = Fleet(fixed, 1, 2, "round-robin", "late", link=Link(gbit * 1e9, layerwise=True,
                                                                                 layers=10)).run(jobs())
        push = Fleet(fixed, 1, 2, "round-robin", "early", link=Link(gbit * 1e9, layerwise=True, layers=10)).run(jobs())
        whole = Fleet(fixed, 1, 2, "round-robin", "early", link=Link(gbit * 1e9, layerwise=False)).run(jobs())
        for d in pull + whole:
            assert d["phases_ms"]["transfer"] == pytest.approx(send_ms(gbit) + 0.5, rel=1e-6)
        tail = max(send_ms(gbit) / 10, send_ms(gbit) + 20.0 / 10 - 20.0)     # the link starts after layer 1
        for d in push:
            assert d["phases_ms"]["transfer"] == pytest.approx(tail + 0.5, rel=1e-6)
    # The first token comes from the prefill's answer (protocol 5): a slower link leaves TTFT alone and
    # delays the second token, which TPOT (first token to last) carries.
    for fast, slow in zip(pulls[1.0], pulls[0.1]):
        assert fast["ttft_ms"] == pytest.approx(slow["ttft_ms"], rel=1e-9)
        extra = (send_ms(0.1) - send_ms(1.0)) / (8 - 1)
        assert slow["tpot_ms"] == pytest.approx(fast["tpot_ms"] + extra, rel=1e-6)
    # Prompts back to back on one prefill worker share its link: the second one's KV waits for the first's.
    # (A step budget of one whole prompt: each is computed in a step of its own, one after the other.)
    burst = [Job(i, 0.0, 1000, 8) for i in range(2)]
    slow = Fleet(fixed, 1, 2, "round-robin", "late", link=Link(0.1e9), token_budget=1000).run(burst)
    assert slow[1]["phases_ms"]["transfer"] == pytest.approx(2 * send_ms(0.1) - 20.0 + 0.5, rel=1e-6)


def test_output_lengths_can_be_drawn_with_a_chosen_spread():
    even = poisson_jobs(costs(), 10.0, 400, 0, output_cv=0.0)
    assert {j.output_tokens for j in even} == {37}                 # the run's mean (16, 32, 64 -> 37.3)
    tailed = [j.output_tokens for j in poisson_jobs(costs(), 10.0, 4000, 0, output_cv=2.0)]
    mean = sum(tailed) / len(tailed)
    assert 30 < mean < 45 and max(tailed) > 10 * mean and sorted(tailed)[len(tailed) // 2] < mean
    assert [j.arrival_s for j in even] == [j.arrival_s for j in poisson_jobs(costs(), 10.0, 400, 0)]


def test_a_run_behind_an_emulated_link_is_replayed_behind_it():
    assert link_of("push-layerwise+late-binding+link=200mbit") == 200e6 and link_of("pull+link=1gbit") == 1e9
    assert link_of("push+decode-policy=load") is None


def test_a_prompt_is_charged_only_the_tokens_its_prefill_computed():
    """Multi-turn runs: the prefill worker's own cache (prefill_cached_tokens) and a fetch (reused_tokens)
    spare it part of the prompt. Calibration fits on what was computed, and the replay charges the same;
    the KV that moves to the decode worker is still the whole prompt's."""
    row = {"prompt_tokens": 1000, "handoff": {"reused_tokens": 256, "prefill_cached_tokens": 512}}
    assert computed_tokens(row) == 232 and computed_tokens({"prompt_tokens": 64, "handoff": {}}) == 64
    assert computed_tokens({"prompt_tokens": 64, "handoff": {"prefill_cached_tokens": 64}}) == 1
    fixed = costs(prefill_ms=Linear(0.0, 0.1), prompt_tokens=[1000], output_tokens=[8],
                  computed_tokens=[250])
    whole, cached = (Fleet(fixed, 1, 2, "round-robin", "early").run([Job(0, 0.0, 1000, 8, n)]) for n in (None, 250))
    assert whole[0]["phases_ms"]["prefill_compute"] == pytest.approx(100.0)
    assert cached[0]["phases_ms"]["prefill_compute"] == pytest.approx(25.0)
    assert whole[0]["phases_ms"]["transfer"] == pytest.approx(cached[0]["phases_ms"]["transfer"])
    assert {j.computed_tokens for j in poisson_jobs(fixed, 10.0, 20, 0)} == {250}


def test_routers_cost_what_the_router_bench_measured():
    """`--router-costs` (the router bench's results.json): a router's decision, the events every router
    absorbs and its idle polls, fitted from the row with the most workers; the requests/s the routers
    can decide grow with their number until the events every one of them absorbs bound them, and a
    fleet simulated behind them queues once the rate nears that bound."""
    rows = [{"workers": 2, "cpu_ms_per_request": 1.0, "requests_per_s": 500.0, "events_per_s": 1000.0,
             "apply_us_per_event": 10.0, "idle_cpu_ms_per_s": 2.0, "index": {"blocks": 1}},
            {"workers": 64, "cpu_ms_per_request": 1.2, "requests_per_s": 400.0, "events_per_s": 800.0,
             "apply_us_per_event": 20.0, "idle_cpu_ms_per_s": 32.0, "index": {"blocks": 1}}]
    router = RouterCosts.from_bench(rows)
    assert router.measured_workers == 64 and router.events_per_request == 2.0
    assert router.decision_ms == pytest.approx(1.2 - 2.0 * 0.020 - 32.0 / 400.0)
    assert router.idle_ms_per_worker_s == pytest.approx(0.5)
    one, four = router.max_rate(1, 64), router.max_rate(4, 64)
    assert one == pytest.approx((1 - 64 * 0.5e-3) / (router.decision_ms / 1e3 + 2 * 20e-6))
    assert 3 * one < four < 4 * one               # every router absorbs every worker's events
    assert router.max_rate(1, 3000) == 0.0        # its polls alone would take the core
    with pytest.raises(ValueError):
        RouterCosts.from_bench([{"workers": 2, "cpu_ms_per_request": 1.0}])

    def ttft_p50(rate: float, routers: int) -> float:
        c = costs()
        jobs = poisson_jobs(c, rate, 300, seed=1)
        done = Fleet(c, 8, 8, routing=Routing(router, routers, rate), seed=1).run(jobs)
        return statistics.median(d["ttft_ms"] for d in done)
    assert ttft_p50(0.95 * one, 1) > ttft_p50(0.95 * one, 2) + 1.0        # queued at the one router
