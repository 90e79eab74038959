"""`kvhandoff demo`, sized to this machine: a short calibration, then isolated requests per mode over the
free link and behind an emulated slow one; the multi-turn part that follows is a `kvhandoff bench` run
the CLI starts with the sizes planned here.

calibrate  colocated on one core, started alone: how long a stack takes to start, words per token of
           the prompt text, a 256-token prompt twice (the second gives the prefill's ms per token and
           the decode step's ms), the KV bytes per token from /health (block_bytes / block_size) and
           the worker's memory besides its pool (RssAnon less the pool).
plan       the stacks that fit in the memory free (the slow link's are skipped if they do not), their
           KV pools sized to the demo's requests, and the largest sizes whose estimated time fits
           --minutes: the isolated part's prompt length,
           output tokens and rounds, then (after it ran, from the time left) the multi-turn part's new
           and answer tokens. The slow link's rate makes moving a prompt's KV take LINK_SHARE of its
           prefill: the regime where the order of the handoff matters (pull and push wait for all of
           it after the prefill; layer-wise push can send it while later layers compute).
isolated   colocated-1core, pull, push, push-layerwise, and the three behind the link, measured in
           rotation round after round (kvhandoff.bench.disagg's isolated run): the table and goals
           (printed, and in summary.txt), isolated.json and isolated_phases.png.
Why isolated requests and not a load grid: a percentile over the few requests five minutes allow on a
slow CPU is an anecdote (an AVX2-only machine once ranked push behind pull that way); one request at a
time with its server-side phases is robust at that size and shows where each order spends its time.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from kvhandoff.bench import disagg
from kvhandoff.bench.client import completion_body, get_json, open_session, stream_completion
from kvhandoff.bench.meta import cpu_model, git_commit, log
from kvhandoff.bench.plots import stacked_phases
from kvhandoff.bench.stack import Stack, process_role, rss_kib, stop_all, stop_on_signal
from kvhandoff.launch.netlink import LinkError, check_available
from kvhandoff.wire.modes import COLOCATED, Mode

MODES = [Mode.PULL, Mode.PUSH, Mode.PUSH_LAYERWISE]
PROBE_TOKENS = 256
LINK_SHARE = 0.75             # the slow link moves a prompt's KV in this share of its prefill's time
LINK_MBIT = (10, 2000)        # the calibrated rate is kept within this (tbf on a veth reaches ~2 Gbit here)
# (prompt tokens, output tokens, rounds) of the isolated part, largest first; the last is the floor
ISOLATED_SIZES = [(1024, 32, 5), (1024, 32, 3), (512, 32, 3), (256, 16, 3), (128, 16, 3)]
# (new tokens per turn, answer tokens) of the multi-turn part, largest first; the last is the floor
MULTITURN_SIZES = [(300, 32), (200, 32), (128, 24), (64, 16), (32, 8)]
CONVERSATIONS, TURNS, THINK_S = 2, 4, 1.0
MULTITURN_SHARE = 0.3         # of the budget kept for the multi-turn part when sizing the isolated one
# Memory: the measured stacks' KV pools hold POOL_SEQUENCES of the longest request (not the default
# 512 MiB: 8 stacks of SmolLM2 in fp32, 14 workers, had 23.8 GiB resident with it and the kernel killed
# workers on a 24 GiB machine); a stack that does not fit in what the machine has free is not started.
POOL_SEQUENCES = 2
ROUTER_BYTES = 200 * 2**20        # a router's resident set, with room (~100 MiB measured)
MEMORY_HEADROOM = 0.85            # of MemAvailable, for what the estimate misses
# What the estimates below leave out (HTTP, the client, warm caches, tokenizing): on a Zen 5 the plan
# estimated 184 s for a demo that took 218 s; every estimate is taken this much larger.
ESTIMATE_MARGIN = 1.2


@dataclass
class Calibration:
    startup_s: float                  # one colocated worker, from start to healthy
    prefill_ms_per_token: float
    step_ms: float
    kv_bytes_per_token: float
    words_per_token: float
    worker_bytes: int = 0             # a worker's resident memory besides its KV pool

    def pool_mb(self) -> int:
        """`--kv-cache-mb` for the measured stacks: POOL_SEQUENCES of the longest isolated request."""
        prompt, output, _ = ISOLATED_SIZES[0]
        return max(16, math.ceil(self.kv_bytes_per_token * (prompt + output) * POOL_SEQUENCES / 2**20 / 16) * 16)

    def stacks_bytes(self, workers: int, routers: int) -> int:
        return workers * (self.worker_bytes + self.pool_mb() * 2**20) + routers * ROUTER_BYTES

    def request_s(self, prompt: int, output: int, transfer_share: float = 0.0) -> float:
        """Estimated seconds of one isolated request; `transfer_share`: a transfer that waits after the
        prefill, as a share of it. A longer prompt costs more per token (attention): 1.2x beyond the probe."""
        prefill_ms = self.prefill_ms_per_token * prompt * (1.2 if prompt > PROBE_TOKENS else 1.0)
        return (prefill_ms * (1 + transfer_share) + output * self.step_ms + 80) / 1e3

    def stacks_startup_s(self, stacks: int) -> float:
        """Stacks started together: each 1P/1D stack is ~2.5 colocated workers' start-up work, on 2 cores."""
        return self.startup_s * max(1.0, 2.5 * stacks / 2)

    def link_rate(self) -> str:
        """tc's spelling of the rate at which a prompt's KV takes LINK_SHARE of its prefill to move."""
        bits_per_s = self.kv_bytes_per_token * 8 / (LINK_SHARE * self.prefill_ms_per_token / 1e3)
        return f"{min(max(round(bits_per_s / 1e6), LINK_MBIT[0]), LINK_MBIT[1])}mbit"


def isolated_s(cal: Calibration, size: tuple[int, int, int], linked: bool) -> float:
    prompt, output, rounds = size
    stacks = 2 + len(MODES)             # colocated on each core, and every mode
    per_round = stacks * cal.request_s(prompt, output)
    warm_up = stacks * (cal.request_s(64, 8) + cal.request_s(prompt, 8))
    if linked:                      # pull and push wait for the whole transfer; layer-wise hides most of it
        per_round += 2 * cal.request_s(prompt, output, LINK_SHARE) + cal.request_s(prompt, output, 0.1)
        warm_up += len(MODES) * (cal.request_s(64, 8) + cal.request_s(prompt, 8, LINK_SHARE))
    return rounds * per_round + warm_up


def multiturn_s(cal: Calibration, new_tokens: int, answer_tokens: int) -> float:
    """push, then push+bidirectional, each started afresh (kvhandoff bench launches one at a time):
    CONVERSATIONS at once, TURNS turns after THINK_S each; the prefill worker's prefix cache is off, so
    at worst every turn recomputes its history (chat template: ~30 tokens a turn)."""
    per_stack = cal.stacks_startup_s(1) + 2 * cal.request_s(64, 4)
    for turn in range(1, TURNS + 1):
        history = turn * (new_tokens + answer_tokens + 30)
        per_stack += THINK_S + CONVERSATIONS * cal.request_s(history, 0) + answer_tokens * cal.step_ms * 1.3 / 1e3
    return 2 * per_stack


def plan_isolated(cal: Calibration, left_s: float, budget_s: float, linked: bool) -> tuple[int, int, int]:
    reserve = max(MULTITURN_SHARE * budget_s, multiturn_s(cal, *MULTITURN_SIZES[-1]))
    room = left_s - ESTIMATE_MARGIN * cal.stacks_startup_s(1 + len(MODES) * (2 if linked else 1)) - reserve
    return next((s for s in ISOLATED_SIZES if ESTIMATE_MARGIN * isolated_s(cal, s, linked) <= room),
                ISOLATED_SIZES[-1])


def plan_multiturn(cal: Calibration, left_s: float) -> tuple[int, int]:
    return next((s for s in MULTITURN_SIZES if ESTIMATE_MARGIN * multiturn_s(cal, *s) <= left_s), MULTITURN_SIZES[-1])


def wanted_link(link: str) -> tuple[bool, str]:
    """(use a slow link, why not / which): 'auto' calibrates the rate, 'none' skips, else a rate."""
    if link == "none":
        return False, "skipped (--link none)"
    try:
        check_available()
    except LinkError as exc:
        return False, f"skipped: {exc}"
    return True, link


def fits_in_memory(cal: Calibration, use_link: bool, link_note: str) -> tuple[bool, str]:
    """(use the slow link, why not): the measured stacks that fit in what this machine has free; a
    SystemExit that says so where not even those over the free link do."""
    available = mem_available_bytes() * MEMORY_HEADROOM
    workers = 1 + 2 * len(MODES)                                         # colocated-core1 and 1P/1D per mode
    free_link = cal.stacks_bytes(workers, len(MODES))
    behind_link = cal.stacks_bytes(2 * len(MODES), len(MODES))
    gib = lambda n: f"{n / 2**30:.1f} GiB"
    if free_link > available:
        raise SystemExit(f"kvhandoff demo: its stacks need about {gib(free_link)} of memory ({workers} "
                         f"workers of {gib(cal.worker_bytes)} with {cal.pool_mb()} MiB KV pools, and their routers); "
                         f"{gib(available)} is free to use here")
    if use_link and free_link + behind_link > available:
        return False, (f"skipped: its {len(MODES)} stacks need about {gib(behind_link)} of memory more than the "
                       f"{gib(free_link)} of the others; {gib(available)} is free to use here")
    return use_link, link_note


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


async def calibrate(bench: disagg.Bench, client: aiohttp.ClientSession, stack: Stack, startup_s: float) -> Calibration:
    await disagg.calibrate(bench, client, stack)
    probes = []
    for i in range(2):              # the first warms the engine up; the second is measured
        body = completion_body(bench.model, bench.prompt(random.Random(f"probe{i}"), PROBE_TOKENS), 16)
        result = await stream_completion(client, stack.url, body)
        if not result.ok or not result.tpot_ms:
            raise RuntimeError(f"calibration request to {stack.name} failed: {result.error or 'no timing'}")
        probes.append(result)
    health = await get_json(client, stack.url + "/health")
    worker = next(pid for pid in stack.pids() if process_role(pid) == "worker")
    pool_bytes = health["num_blocks"] * health["block_bytes"]       # (a colocated worker's pool is its own memory)
    cal = Calibration(startup_s=startup_s, prefill_ms_per_token=probes[-1].ttft_ms / probes[-1].prompt_tokens,
                      step_ms=probes[-1].tpot_ms, kv_bytes_per_token=health["block_bytes"] / health["block_size"],
                      words_per_token=bench.words_per_token,
                      worker_bytes=max(0, (rss_kib(worker, "RssAnon") or 0) * 1024 - pool_bytes))
    log(f"calibrated: started in {startup_s:.1f} s, prefill {cal.prefill_ms_per_token:.2f} ms/token, decode step "
        f"{cal.step_ms:.1f} ms, KV {cal.kv_bytes_per_token / 1024:.1f} KiB/token ({health.get('dtype')}), "
        f"{cal.worker_bytes / 2**20:.0f} MiB a worker besides its pool")
    return cal


def start_measured(stacks: list[Stack], optional: list[Stack]) -> str | None:
    """Start all at once; the free-link ones must come up, the `optional` (linked) ones may fail: then
    they are stopped and dropped, and the reason returned."""
    for stack in stacks + optional:
        stack.start()
        log(f"starting {stack.name} (log {stack.log_path})")
    for stack in stacks:
        stack.wait_ready()
    try:
        for stack in optional:
            stack.wait_ready()
    except (RuntimeError, TimeoutError) as exc:
        stop_all(optional)
        return f"skipped: {exc}"
    return None


def phase_plot(summary: dict, path: Path) -> None:
    rows = next(iter(summary.values()))
    names = [n for n, r in rows.items() if r["n"]]
    # The handoff's phases end at the decode worker's first step, which makes the SECOND token (the
    # first leaves with the prefill's answer): the bars are measured against the client's second token.
    second = [rows[n]["ttft_ms"] + (rows[n]["second_token_ms"] or 0.0) if rows[n]["ttft_ms"] is not None else None
              for n in names]
    stacked_phases(names, [rows[n]["phases_ms"] for n in names], path, "ms (median of isolated requests)",
                   "isolated requests: where the time to the second token goes, per mode and link", second,
                   "second token (client)")


async def run(bench: disagg.Bench, budget_s: float, started: float, link: str) -> dict:
    args = bench.args
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"meta": {"model": args.model, "git_commit": git_commit(), "cpu": cpu_model(),
                             "cores": sorted(os.sched_getaffinity(0)), "budget_s": budget_s,
                             "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "pinning": "colocated-1core: core 0, colocated-core1: core 1, 1 thread each; "
                                        "disaggregated: prefill core 0, decode core 1, 1 thread each, "
                                        "routers on the prefill core; this client off the core whose engine "
                                        "makes the tokens"}}
    async with open_session() as client:
        try:
            one_core = bench.stack(disagg.BASELINE_1CORE, COLOCATED, "0")
            t0 = time.monotonic()
            disagg.start_stacks([one_core])
            bench.model = one_core.model_name()
            cal = await calibrate(bench, client, one_core, time.monotonic() - t0)
            use_link, link_note = wanted_link(link)
            use_link, link_note = fits_in_memory(cal, use_link, link_note)
            # (colocated-1core, started for the calibration, keeps the default pool: a step reads its
            # sequences' blocks, not the pool, so the pool's size changes no figure here)
            args.worker_args = ["--kv-cache-mb", str(cal.pool_mb())]
            rate = (cal.link_rate() if link == "auto" else link) if use_link else None
            prompt, output, rounds = plan_isolated(cal, budget_s - (time.monotonic() - started), budget_s, use_link)
            log(f"plan: isolated {prompt}-token prompts, {output} tokens out, {rounds} rounds, {cal.pool_mb()} MiB "
                f"KV pools; slow link "
                + (f"{rate} (KV of a prompt in ~{LINK_SHARE:.0%} of its prefill)" if rate else link_note))
            args.lengths, args.output_tokens, args.repeats = [prompt], output, rounds
            # colocated again on the decode workers' core: their steps are judged against it (disagg.py)
            free = [bench.stack(disagg.BASELINE_DECODE_CORE, COLOCATED, "1"),
                    *(bench.stack(m, m, "0,1") for m in MODES)]
            linked = [bench.stack(f"{m}@{rate}", m, "0,1", "--link", rate) for m in MODES] if rate else []
            failed = start_measured(free, linked)
            if failed:
                link_note, rate = failed, None
                log(f"slow link {failed}")
                for stack in linked:
                    del bench.stacks[stack.name]
            args.links = [disagg.FREE, rate] if rate else [disagg.FREE]
            samples = await disagg.run_isolated(bench, client)
        finally:
            stop_all(bench.stacks.values())
    names = list(bench.stacks)
    summary = disagg.summarize_isolated(samples, names, args.lengths)
    goals = disagg.isolated_goals(summary)
    with contextlib.redirect_stdout(io.StringIO()) as table:
        disagg.print_isolated(summary, goals)
        if not rate:
            print(f"  slow link {link_note}")
    print(table.getvalue(), end="", flush=True)
    (args.out / "summary.txt").write_text(table.getvalue())
    report.update(calibration=asdict(cal), link=rate, link_note=None if rate else link_note,
                  plan={"prompt_tokens": prompt, "output_tokens": output, "rounds": rounds, "kv_cache_mb": cal.pool_mb()},
                  isolated=summary, isolated_goals=goals, samples=[s.to_json() for s in samples])
    (args.out / "isolated.json").write_text(json.dumps(report, indent=1))
    phase_plot(summary, args.out / "isolated_phases.png")
    return report


def isolated_part(model: str, out: Path, budget_s: float, started: float, link: str) -> Calibration:
    """Run the calibration and the isolated part into `out`; the calibration sizes what follows."""
    args = argparse.Namespace(model=model, modes=MODES, links=[disagg.FREE], lengths=[], repeats=0, output_tokens=0,
                              seed=0, worker_args=[], free_placement=False, out=out)
    bench = disagg.Bench(args)
    stop_on_signal(lambda: list(bench.stacks.values()))
    report = asyncio.run(run(bench, budget_s, started, link))
    return Calibration(**report["calibration"])
