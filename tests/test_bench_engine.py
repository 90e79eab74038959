"""The engine benchmark script runs end to end on the tiny model and writes every figure it promises.

It runs as a subprocess, exactly as a person would run it, on sizes small enough for CI (seconds);
the figures themselves are not judged here (timings on a shared machine are noise at this size),
only that they exist, are positive, and carry what MEASURING.md says every result must record.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ARGS = ["--model", "tiny", "--dtype", "float32", "--repeats", "1", "--prompt-len", "64",
        "--decode-tokens", "8", "--concurrency", "4", "--threads", "1", "--cached-prefix", "64", "--cached-new", "16",
        "--mixed-chunk", "24", "--dtypes-compare"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "kvhandoff.bench.engine", *ARGS, "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_records_what_was_measured(report):
    data, _ = report
    meta = data["meta"]
    assert meta["model"] == "tiny" and meta["dtype"] == "float32" and meta["threads"] == [1]
    assert meta["prompt_len"] == 64 and meta["decode_tokens"] == 8 and meta["concurrency"] == 4
    assert meta["prefix_caching"] is False and meta["block_size"] > 0
    for key in ("torch_version", "transformers_version", "git_commit", "hf_mode", "cpu_affinity"):
        assert meta[key], key
    assert meta["kernels"].startswith(("on", "off"))


def test_timings_positive_for_ours_and_hf(report):
    data, _ = report
    rec = data["results"]["1"]
    # With the kernels on, the same engine on torch's paths is the third side (the A/B for them).
    sides = ("ours", "torch", "hf") if data["meta"]["torch_paths_side"] else ("ours", "hf")
    assert data["meta"]["torch_paths_side"] == data["meta"]["kernels"].startswith("on")
    for kind in ("prefill", "tpot", "concurrent"):
        for side in sides:
            runs = rec[kind][side]["runs"]
            assert len(runs) == 1 and all(v > 0 for v in runs), (kind, side)
            assert rec[kind][side]["median"] > 0
            assert len(rec[kind][side]["loadavg"]) == 1 and len(rec[kind][side]["loadavg"][0]) == 3
        assert rec[kind]["speedup_vs_hf"] > 0
        assert rec[kind].get("speedup_vs_torch", 1) > 0
    assert rec["concurrent"]["ours_x_single_stream"] > 0
    # The engine's own time per decode step beside the forward pass: a part of the step's time.
    step_ms = {"tpot": rec["tpot"]["ours"]["median"], "concurrent": 4 * 1e3 / rec["concurrent"]["ours"]["median"]}
    for kind, ms in step_ms.items():
        assert 0 < rec[kind]["ours"]["step_overhead_ms"] < ms, (kind, rec[kind]["ours"]["step_overhead_ms"], ms)


def test_greedy_outputs_agree_with_hf_in_fp32(report):
    # The tiny model's logits match HF to < 1e-3 in fp32 (test_model), so greedy tokens must agree,
    # and batching must not change what a sequence generates.
    check = report[0]["results"]["1"]["greedy_check"]
    assert check["ours_vs_hf_first_token_equal"]
    assert check["ours_vs_hf_matching_prefix"] == check["of_tokens"] == 8
    assert check["ours_batched_vs_alone_matching_prefix"] == 8
    if report[0]["meta"]["torch_paths_side"]:       # the kernels give torch's tokens
        assert check["ours_vs_torch_matching_prefix"] == check["ours_vs_torch_batched_matching_prefix"] == 8


def test_decode_steps_with_a_growing_batch_and_a_chunk(report):
    data, stdout = report
    steps = data["results"]["1"]["decode_steps"]
    assert steps["chunk_tokens"] == 24
    for key in ("one_median_ms", "three_median_ms", "three_plus_chunk_median_ms", "three_x_one", "chunk_x_three"):
        assert steps[key] > 0, key
    assert "decode step (ms): 1 sequence" in stdout


def test_goals_and_table(report):
    data, stdout = report
    goals = data["goals"]
    assert {g["threads"] for g in goals} == {1}
    assert all(g["met"] in (True, False) for g in goals)     # HF ran, so every goal has a verdict
    assert any("HF" in g["goal"] for g in goals) and any("ref" in g["goal"] for g in goals)
    assert "prefill 64 tok (ms)" in stdout and "580" in stdout and ("met" in stdout)


def test_cached_prefill_and_limits(report):
    """The cached-prefix prefill is measured against the same new tokens alone, and every figure
    comes with the machine's floor for it (measured rates, model dimensions)."""
    data, stdout = report
    rec = data["results"]["1"]
    cached = rec["cached_prefill"]
    assert cached["prefix_tokens"] == 64 and cached["new_tokens"] == 16
    assert cached["ours"]["median"] > 0 and cached["alone_median_ms"] > 0 and cached["x_alone"] > 0
    limits = rec["limits"]
    assert limits["rates"]["matmul_gflops"] > 0 and limits["rates"]["read_gbps"] > 0
    assert limits["rates"]["threads"] == 1 and limits["rates"]["dtype"] == "float32"
    assert set(limits["figures"]) == {"prefill_ms", "tpot_ms", "concurrent_step_ms", "cached_prefill_ms",
                                      "new_tokens_alone_ms"}
    for name, figure in limits["figures"].items():
        assert figure["floor"] > 0 and figure["x_floor"] == pytest.approx(figure["measured"] / figure["floor"], rel=0.01), name
    for name in ("tpot_ms", "concurrent_step_ms"):          # read rates measured beside each round (one here)
        figure = limits["figures"][name]
        assert len(figure["read_gbps_per_round"]) == 1 and figure["read_gbps_per_round"][0] > 0, figure
        assert figure["x_floor_per_round"] == [figure["x_floor"]], figure
        assert "core_handoff_ns_per_round" not in figure        # (one thread: no second core to hand to)
    assert "x floor" in stdout and "GFLOP/s" in stdout and "GB/s beside its rounds" in stdout


def test_two_threads_rounds_record_how_long_a_line_took_between_cores():
    """On two threads each decode round is set beside the read rate and the cross-core handoff time
    measured right after it (RoundReadRates), what tells one CCX from two CCDs in a VM's results."""
    from kvhandoff.bench.limits import RoundReadRates
    from kvhandoff.model import kernels
    if kernels.core_handoff_ns(10) is None:
        pytest.skip("no compiled kernels or a single core here")
    reads, handoffs = {"ours": []}, {"ours": []}
    RoundReadRates().after(reads, handoffs)("ours")
    assert len(reads["ours"]) == len(handoffs["ours"]) == 1 and reads["ours"][0] > 0 and handoffs["ours"][0] > 1


def test_dtypes_compare_sets_each_dtype_beside_its_own_floor(report):
    data, stdout = report
    compared = data["dtypes_compare"]
    for dtype in ("float32", "bfloat16"):
        floor = compared["floors"][dtype]
        assert floor["prefill_ms"] > 0 and floor["tpot_ms"] > 0 and floor["rates"]["matmul_gflops"] > 0, floor
        assert compared["tpot"][dtype]["median"] > 0
        # TPOT's read rate measured beside its round (one here): its x floor is that round's own
        assert len(floor["read_gbps_per_round"]) == 1 and floor["read_gbps_per_round"][0] > 0, floor
        assert floor["tpot_x_floor"] == pytest.approx(compared["tpot"][dtype]["median"] / floor["tpot_ms"], rel=0.01)
    assert stdout.count("x its floor") == 4, stdout[-2000:]
