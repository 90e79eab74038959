"""`kvhandoff bench` end to end: pick targets (a URL, or stacks it launches), build the workload,
measure every point, write the outputs. The parser lives in kvhandoff.cli; this is what it runs."""
from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import aiohttp

from kvhandoff.bench import workload as W
from kvhandoff.bench.client import completion_body, get_json, open_session, random_text, stream_completion
from kvhandoff.bench.harness import Point, run_meta, run_point, write_outputs
from kvhandoff.bench.meta import log
from kvhandoff.bench.stack import Stack, cpu_seconds, process_role, stop_on_signal, thread_cpu_seconds
from kvhandoff.wire.modes import STACK_MODES

READ_TIMEOUT_S = 900.0
WORKLOADS = ("grid", "binding", "multiturn")          # generated; anything else is a file to replay
LAUNCH_FLAGS = ("bidirectional", "retry-colocated", "late-binding", "no-prefix-caching")
# NAME=VALUE; link: a rate only (its delay would need a comma, which separates the specs)
LAUNCH_OPTIONS = ("decode-policy", "prefill-policy", "disagg-min-tokens", "health-interval", "link",
                  "retention-ttl", "reuse-policy")


def launch_spec(spec: str) -> tuple[str, list[str]]:
    """'push+late-binding+decode-policy=load' -> ('push', ['--late-binding', '--decode-policy', 'load']):
    a mode and `kvhandoff up` flags (their values are checked by `up`'s own parser: cli.cmd_bench)."""
    mode, *flags = spec.split("+")
    if mode not in STACK_MODES:
        raise ValueError(f"unknown mode {mode!r} in --launch {spec!r}; modes: {', '.join(STACK_MODES)}")
    argv = []
    for flag in flags:
        name, eq, value = flag.partition("=")
        if name in LAUNCH_FLAGS and not eq:
            argv.append(f"--{name}")
        elif name in LAUNCH_OPTIONS and value:
            argv += [f"--{name}", value]
        else:
            raise ValueError(f"unknown flag {flag!r} in --launch {spec!r}; flags: {', '.join(LAUNCH_FLAGS)}; "
                             f"options: {', '.join(o + '=VALUE' for o in LAUNCH_OPTIONS)}")
    return mode, argv


class BenchError(Exception):
    """Something the user must fix (unreachable target, bad workload file): one clear line, no traceback."""


async def served_model(client: aiohttp.ClientSession, url: str) -> dict:
    try:
        return (await get_json(client, url + "/v1/models", timeout_s=10.0))["data"][0]
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"{url} does not answer GET /v1/models like an OpenAI-compatible server: "
                         f"{type(exc).__name__}: {exc}") from None


async def calibrate(client: aiohttp.ClientSession, url: str, model: str, output_tokens: int) -> dict:
    """Words per token of the generated text, and one long request's TTFT and TPOT on this target."""
    probe = await stream_completion(client, url, completion_body(model, random_text(random.Random(-1), 1024), 32))
    if not probe.ok or not probe.prompt_tokens:
        raise BenchError(f"calibration request to {url} failed: {probe.error or 'no usage reported'}")
    return {"words_per_token": 1024 / probe.prompt_tokens, "ttft_ms": probe.ttft_ms, "tpot_ms": probe.tpot_ms,
            "prompt_tokens": probe.prompt_tokens}


def auto_longest(cal: dict, output_tokens: int, max_model_len: int) -> int:
    """The original experiment's longest prompts (16k) take about as long to prefill as decoding its
    128 tokens; choose the length with the same ratio here (prefill time ~ linear in length)."""
    per_token_ms = cal["ttft_ms"] / cal["prompt_tokens"]
    longest = round(output_tokens * (cal["tpot_ms"] or 0) / per_token_ms)
    return max(256, min(longest, max_model_len - output_tokens - 8))


async def capacity(client: aiohttp.ClientSession, url: str, model: str, args, words_per_token: float) -> float:
    """Requests per second the target completes given a burst from the grid's length mix."""
    items = W.grid(args.seed + 7919, args.capacity_requests, 1e9, args.shortest, args.longest, words_per_token,
                   args.output_tokens)
    point = Point("capacity", "capacity", url, None, [W.WorkItem(0.0, prompt=i.prompt, max_tokens=i.max_tokens)
                                                     for i in items])
    await run_point(client, point, model)
    failed = [r.error for r in point.results if not r.ok]
    if failed:
        raise BenchError(f"capacity burst against {url}: {len(failed)} of {len(items)} failed, e.g. {failed[0]}")
    return len(point.results) / point.wall_s


def build_workload(args, words_per_token: float, rate: float | None) -> list[W.WorkItem]:
    if args.workload == "grid":
        return W.grid(args.seed, args.requests, rate, args.shortest, args.longest, words_per_token, args.output_tokens)
    if args.workload == "binding":
        return W.binding(args.seed, args.requests, rate, args.shortest, args.longest, words_per_token,
                         args.output_tokens)
    if args.workload == "multiturn":
        return W.multiturn(args.seed, args.conversations, args.turns, args.new_tokens, args.answer_tokens,
                           args.think_s, words_per_token, resumed_after_s=args.resume_after_s,
                           think=W.think_times(args.think_profile) if args.think_profile else None)
    return W.load(Path(args.workload))


async def measure_target(client, args, url: str, mode: str, model: str, cal: dict,
                         loads: list[tuple[float, float] | None], stack: Stack | None = None) -> list[Point]:
    """One point per load (fraction of capacity, rate in requests/s), or one replayed point (None).
    A stack we launched also has its processes' CPU time per role measured over each point."""
    points = []
    for load in loads:
        rate = None if load is None else load[1]
        items = build_workload(args, cal["words_per_token"], rate)
        if args.save_workload and not points:
            W.save(items, args.save_workload)
            log(f"workload saved to {args.save_workload}")
        label = mode if load is None else f"{mode}@{load[0]:g}x"
        point = Point(label, mode, url, rate, items)
        try:        # what the target says it runs (ours: model, dtype, block size, prefix caching, roles)
            point.server = await get_json(client, url + "/health", timeout_s=10.0)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            point.server = None
        log(f"{label}: {len(items)} requests")
        pids = stack.pids() if stack is not None else []
        routers = [pid for pid in pids if process_role(pid) == "router"]
        router_cpu = lambda: sum(thread_cpu_seconds(pid) for pid in routers)
        sampler = asyncio.ensure_future(sample_decode_load(client, url, point))
        try:
            if routers:         # what the router spends with nothing in flight (health polls, this sampler)
                idle_before, idle_started = router_cpu(), time.perf_counter()
                await asyncio.sleep(IDLE_SAMPLE_S)
                point.router_idle_cpu_s_per_s = (router_cpu() - idle_before) / (time.perf_counter() - idle_started)
            before, router_before = cpu_seconds(pids), router_cpu()
            await run_point(client, point, model)
        finally:
            sampler.cancel()
        if stack is not None:
            after = cpu_seconds(pids)
            point.cpu_s = {role: round(after[role] - before.get(role, 0.0), 3) for role in after}
        if routers:
            point.router_cpu_s = router_cpu() - router_before
        points.append(point)
    return points


# How long a point's stack is watched idle first: the router's health polls (and the load sampler's)
# cost CPU whether or not requests run, which divided by a handful of requests once read as 21 ms of
# routing per request.
IDLE_SAMPLE_S = 1.0


async def sample_decode_load(client: aiohttp.ClientSession, url: str, point: Point, every_s: float = 0.5) -> None:
    """While the point runs: the sequences each decode worker holds (running, waiting, waiting for
    KV) and the bytes of KV it retains for later turns, from a router's /health every `every_s` (a
    target that is not our router: nothing)."""
    while True:
        try:
            health = await get_json(client, url + "/health", timeout_s=5.0)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return
        workers = [w for w in health.get("workers") or [] if w.get("role") == "decode"] if isinstance(health, dict) else []
        if not workers:
            return
        if not point.started_at:            # (polling already while the stack's idle CPU is measured)
            await asyncio.sleep(every_s)
            continue
        at = round(time.perf_counter() - point.started_at, 3)
        point.timeline.append((at, {w["url"]: sum(int(w.get(k) or 0) for k in ("num_running", "num_waiting",
                                                                                 "num_waiting_for_kv")) for w in workers}))
        point.retained.append((at, {w["url"]: int(w.get("num_retained_blocks") or 0) * int(w.get("block_bytes") or 0)
                                    for w in workers}))
        await asyncio.sleep(every_s)


async def amain(args, stacks: list[Stack]) -> int:
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    args.out.mkdir(parents=True, exist_ok=True)
    points: list[Point] = []
    async with open_session(READ_TIMEOUT_S) as client:
        if args.target:
            targets = [("target", args.target.rstrip("/").removesuffix("/v1"))]
        else:
            targets = [(mode, None) for mode in args.launch]
        model = None
        cap = args.capacity
        for mode, url in targets:
            stack = None
            if url is None:
                base, flags = launch_spec(mode)
                stack = Stack(mode, base, args.cores, ["--model", args.model, *flags, *args.launch_args],
                              args.out / "logs" / f"{mode}.log")
                stacks.append(stack)
                stack.start()
                log(f"launching {mode} (log {stack.log_path})")
                try:
                    stack.wait_ready(args.startup_timeout)
                except (RuntimeError, TimeoutError) as exc:
                    raise BenchError(str(exc)) from None
                url = stack.url
            try:
                card = await served_model(client, url)
                model = model or args.served_name or card["id"]
                cal = await calibrate(client, url, model, args.output_tokens)
                if args.workload in ("grid", "binding"):
                    if args.longest is None:
                        args.longest = auto_longest(cal, args.output_tokens, card.get("max_model_len") or 4096)
                        log(f"longest prompt {args.longest} tokens (its prefill ~ {args.output_tokens} decode steps "
                            "here)")
                    args.shortest = args.shortest or max(16, args.longest // 16)
                    if cap is None:
                        log(f"measuring the capacity of {mode} ({args.capacity_requests}-request burst)")
                        cap = await capacity(client, url, model, args, cal["words_per_token"])
                        log(f"capacity {cap:.3f} req/s")
                    loads = [(f, f * cap) for f in args.rates]
                else:
                    loads = [None]
                points += await measure_target(client, args, url, mode, model, cal, loads, stack)
            finally:
                if stack is not None:
                    stack.stop()
    meta = run_meta(args, model or "?", args.target or f"kvhandoff up --mode {','.join(args.launch)}", started)
    meta["capacity_req_s"] = cap
    summaries = write_outputs(args.out, meta, points, args.slo_ttft_ms, args.slo_tpot_ms)
    print((args.out / "summary.md").read_text(), flush=True)
    failed = sum(s["failed"] for s in summaries)
    log(f"wrote {args.out}/results.jsonl, summary.json, summary.md" + (f"; {failed} requests failed" if failed else ""))
    return 0


def main(args: argparse.Namespace) -> int:
    if args.workload not in WORKLOADS and not Path(args.workload).is_file():
        raise SystemExit(f"kvhandoff bench: --workload must be grid, binding, multiturn or a JSON-lines file; "
                         f"{args.workload!r} is none of them")
    if args.workload not in WORKLOADS:
        try:
            W.load(Path(args.workload))
        except ValueError as exc:
            raise SystemExit(f"kvhandoff bench: {exc}") from None
    if args.think_profile:
        try:
            W.think_times(args.think_profile)
        except ValueError as exc:
            raise SystemExit(f"kvhandoff bench: {exc}") from None
    stacks: list[Stack] = []
    stop_on_signal(lambda: stacks)
    try:
        return asyncio.run(amain(args, stacks))
    except BenchError as exc:
        raise SystemExit(f"kvhandoff bench: {exc}") from None
    finally:
        for stack in stacks:
            stack.stop()
