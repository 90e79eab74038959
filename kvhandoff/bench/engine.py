"""Engine benchmark: our paged-KV engine against Hugging Face transformers, side by side in one run.

    python -m kvhandoff.bench.engine [--model smollm2] [--dtype auto] [--threads 1,2] [--repeats 5]
        [--prompt-len 1024] [--decode-tokens 128] [--concurrency 16] [--cached-prefix 1792]
        [--cached-new 328] [--json FILE] [--no-hf] [--no-torch-paths] [--dtypes-compare]

Measured per thread count (issue 2, "Must show (benchmark script)"), each figure for three sides:
ours (the engine as served), torch (the same engine with cpu_kernels=False: torch's paths only,
what ran before kvhandoff.model.kernels; shown when the kernels are on) and HF:
  prefill     one prompt of --prompt-len tokens, to its first token.
              ours: LLMEngine.generate with max_tokens=1, budget >= the prompt (one-shot prefill);
              HF: one forward over the prompt (DynamicCache built, logits of the last position only).
  tpot        single-stream time per output token over --decode-tokens tokens, after the same prompt:
              (time of the last token - time of the first token) / (decode_tokens - 1), by step timing.
  concurrent  aggregate decode tokens/s of --concurrency sequences admitted at once: tokens produced
              after every sequence has its first token, divided by the time that took. The prompts have
              equal lengths (distinct text), so HF's batch needs no padding and does the same work.

Ours only:
  cached      --cached-new new tokens prefilled after a --cached-prefix prefix the prefix cache
              holds, against the same number of new tokens alone (ratio per round, then median).
  steps       one decode step with 1 sequence, with 3, and with the 3 sharing it with a fresh
              prefill chunk of --mixed-chunk tokens (needs --concurrency >= 3).
  limits      the machine's rates measured on the same threads (matrix throughput of the dtype at
              the prefill's shapes, memory read bandwidth) and each figure beside its floor
              (kvhandoff.bench.limits): how much of the machine the engine leaves unused. The
              decode figures' read rate is measured right after each of their rounds, and each
              round is set beside its own floor (the rate moves with other tenants' load).

HF runs a manual greedy loop over model.forward with past_key_values (exactly the forward passes
`generate` makes, without its logits-processor / stopping-criteria bookkeeping, i.e. HF's best
case) under torch.inference_mode, with the model's default attention implementation (sdpa).

Method (../shared/MEASURING.md): warm-up of every measurement first; then --repeats rounds, each
running the sides back to back, alternating the order (A B C, C B A, ...) so drift hits all;
medians of each side and the median of the pairwise ratios; os.getloadavg() before every
measurement, and how long our threads waited for a core during it (schedstat: the direct sign that
other work shared the cores; such rows are marked busy); prefix caching off (repeats reuse the
prompt); ignore_eos so every run produces exactly the requested tokens; greedy outputs of ours and
HF are compared (correctness beside speed).
Progress goes to stderr, the table to stdout, every figure to --json.
"""
from __future__ import annotations

import argparse
import functools
import gc
import inspect
import itertools
import json
import os
import platform
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch

from kvhandoff.bench.limits import ModelWork, RoundReadRates, as_dict, paired_decode_floor, probe
from kvhandoff.bench.meta import cpu_model, git_commit, log, median
from kvhandoff.config import EngineConfig
from kvhandoff.engine.engine import LLMEngine
from kvhandoff.engine.request import FinishReason, SamplingParams

# Issue 2's reference, as the issue states it: a mature CPU serving engine, same weights in bf16,
# "on this machine" (which the issue says has AMX; the machines seen so far have AVX512-BF16 only).
REFERENCE = {"prefill_ms": {1: 580.0, 2: 340.0}, "tpot_ms": {1: 47.0, 2: 35.0}}
GOAL_PREFILL_X_REF = 1.4        # our prefill <= 1.4x the reference
GOAL_TPOT_X_REF = 1.3           # our time per output token <= 1.3x the reference
GOAL_CONCURRENT_X_SINGLE = 6.0  # N-way aggregate decode >= 6x single-stream throughput
GOAL_X_HF = 1.0                 # >= 1.0x HF everywhere
BUSY_WAIT_SHARE = 0.05          # a run whose threads waited for a core longer than this shared them
# ours: the engine as served; torch: the same engine on torch's paths only (cpu_kernels=False: what
# main ran before the kernels, the A/B for them); hf: Hugging Face transformers.
SIDES = ("ours", "torch", "hf")
DECODE_KINDS = ("tpot", "concurrent")      # figures whose floor is the memory read rate

_ids = itertools.count()


def runqueue_wait_ns() -> dict[int, int] | None:
    """Per thread of this process: ns spent runnable but waiting for a CPU (Linux schedstat)."""
    try:
        out = {}
        for task in Path("/proc/self/task").iterdir():
            try:
                out[int(task.name)] = int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                pass                    # thread exited meanwhile
        return out
    except OSError:
        return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` tokens, cut from real text (stdlib sources, fixed per
    Python version) so greedy continuations are confident enough to compare ours with HF."""
    text = "\n".join(Path(m.__file__).read_text() for m in (argparse, textwrap, json.decoder, statistics))
    ids = tokenizer.encode(text)
    while len(ids) < count * length:
        ids = ids + ids
    return [ids[i * length:(i + 1) * length] for i in range(count)]


# ---- one measurement each; every function returns seconds (and the tokens, for correctness) -------

def ours_prefill(engine: LLMEngine, prompt: list[int]) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    out = engine.generate([prompt], params)
    sync(engine.device)
    return time.perf_counter() - t0, out[0]


def ours_cached_prefill(engine: LLMEngine, prefix: list[int], new_tokens: list[int]) -> tuple[float, float]:
    """(seconds to prefill `new_tokens` after `prefix` is in the prefix cache, seconds to prefill
    `new_tokens` alone). The prefix is computed first and its blocks stay cached; distinct
    `new_tokens` per call, so nothing of them is cached."""
    pool, caching = engine.pool, engine.pool.enable_prefix_caching
    pool.enable_prefix_caching = True
    try:
        ours_prefill(engine, prefix)                    # cache the prefix (no-op when still cached)
        hits = pool.hits
        cached_s, _ = ours_prefill(engine, prefix + new_tokens)
        assert pool.hits > hits, "the prefix was not served from the cache"
    finally:
        pool.enable_prefix_caching = caching
    alone_s, _ = ours_prefill(engine, new_tokens)
    return cached_s, alone_s


def ours_decode(engine: LLMEngine, prompts: list[list[int]], n: int,
                overhead_ms: list[float] | None = None) -> tuple[float, float, list[list[int]]]:
    """All prompts admitted at once; returns (seconds to every first token, seconds of the decode
    phase after it, outputs). Step timing, so the decode phase holds only decode steps. Appends to
    `overhead_ms`, if given, the decode phase's mean time per step outside the forward pass."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    rids = [f"bench-{next(_ids)}" for _ in prompts]
    outputs: dict[str, list[int]] = {r: [] for r in rids}
    t0 = time.perf_counter()
    for rid, prompt in zip(rids, prompts):
        engine.add_request(rid, prompt, params)
    pending, waiting_first, t_first, steps = set(rids), set(rids), None, 0
    while pending:
        outs = engine.step()
        if not outs and not engine.has_work():
            raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
        for out in outs:
            if out.finish_reason == FinishReason.ERROR:
                raise RuntimeError(out.error)
            outputs[out.request_id] += out.new_token_ids
            waiting_first.discard(out.request_id)
            if out.finished:
                pending.discard(out.request_id)
        if t_first is None and not waiting_first:
            sync(engine.device)
            t_first, forward_first, steps = time.perf_counter(), engine.forward_s, 0
        steps += t_first is not None
    sync(engine.device)
    t_end = time.perf_counter()
    if overhead_ms is not None and steps > 1:
        # The step that gave the last first token is not part of the decode phase.
        overhead_ms.append(((t_end - t_first) - (engine.forward_s - forward_first)) * 1e3 / (steps - 1))
    return t_first - t0, t_end - t_first, [outputs[r] for r in rids]


@torch.inference_mode()
def hf_decode(model, prompts: list[list[int]], n: int) -> tuple[float, float, list[list[int]]]:
    """HF's forward passes as `generate` makes them, greedy; same return as ours_decode.
    n=1 is the prefill measurement: one forward over the prompt."""
    device = model.device
    # transformers >= 5.2x renamed past_key_values to cache (the old name still works, with a warning).
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor(prompts, device=device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, tok = getattr(out, cache_arg), out.logits[:, -1].argmax(-1)
    tokens = [tok.tolist()]             # to Python each step, as a server must (and as ours does)
    t_first = time.perf_counter()
    for _ in range(n - 1):
        out = model(input_ids=tok[:, None], use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        tok = out.logits[:, -1].argmax(-1)
        tokens.append(tok.tolist())
    sync(device)
    t_end = time.perf_counter()
    return t_first - t0, t_end - t_first, [list(col) for col in zip(*tokens)]


# ---- the run -----------------------------------------------------------------------------------

def run_pair(name: str, threads: int, fns: dict, record: dict, round_index: int, after=None) -> None:
    """Run each side once (order alternates per round) with the load average noted before each;
    after(side), if given, right after each side's measurement (outside its time)."""
    order = list(fns) if round_index % 2 == 0 else list(fns)[::-1]
    for side in order:
        torch.set_num_threads(threads)      # process-wide: set before every timed block
        gc.collect()
        load = os.getloadavg()
        wait0, wall0, cpu0 = runqueue_wait_ns(), time.perf_counter(), time.process_time()
        value, extra = fns[side]()
        wall = time.perf_counter() - wall0
        # CPU time our threads got, and time they were runnable but waiting for a core, as shares of
        # what `threads` threads could have had: waiting means other work took our cores (OpenMP
        # threads then stall on a descheduled sibling at every barrier: tens of times slower).
        cpu_share = (time.process_time() - cpu0) / (wall * threads)
        wait_after = runqueue_wait_ns()
        waited = None if wait0 is None or wait_after is None else \
            sum(ns - wait0.get(tid, 0) for tid, ns in wait_after.items()) / 1e9 / (wall * threads)
        record[side]["runs"].append(value)
        record[side]["loadavg"].append([round(x, 2) for x in load])
        record[side]["cpu_share"].append(round(cpu_share, 3))
        record[side]["runqueue_wait_share"].append(None if waited is None else round(waited, 3))
        if extra is not None:
            record[side]["last_output"] = extra
        log(f"  {name:<10} threads={threads} {side:<8} {value:10.2f} {record['unit']:<6} load={load[0]:.2f} "
            f"cpu_share={cpu_share:.2f} runq_wait={'-' if waited is None else f'{waited:.2f}'}")
        if after is not None:
            after(side)


def summarize(record: dict, higher_is_better: bool) -> None:
    sides = [s for s in SIDES if s in record]
    for side in sides:
        record[side]["median"] = median(record[side]["runs"])
    for other in sides[1:]:
        # Speedup of ours over the other side per round (>1: ours is better), then its median.
        pairs = zip(record["ours"]["runs"], record[other]["runs"])
        record[f"speedup_vs_{other}_runs"] = [o / h if higher_is_better else h / o for o, h in pairs]
        record[f"speedup_vs_{other}"] = median(record[f"speedup_vs_{other}_runs"])


class CachedPrefill:
    """Prefill over a cached prefix against the same number of new tokens alone (ours only: the
    ratio is the point), each round with new tokens never seen before."""

    def __init__(self, args, engine: LLMEngine):
        self.engine = engine
        self.prefix = make_prompts(engine.tokenizer, 1, args.cached_prefix)[0]
        self.suffixes = iter(make_suffixes(engine.tokenizer, args.cached_new))
        self.record = new_record("ms", ["ours"]) | {"alone_ms": [], "prefix_tokens": args.cached_prefix,
                                                     "new_tokens": args.cached_new}

    def measure(self) -> tuple[float, None]:
        cached_s, alone_s = ours_cached_prefill(self.engine, self.prefix, next(self.suffixes))
        self.record["alone_ms"].append(alone_s * 1e3)
        return cached_s * 1e3, None

    def warm_up(self) -> None:
        self.measure()
        self.record["alone_ms"].clear()

    def summary(self) -> dict:
        rec = self.record
        rec["ours"]["median"], rec["alone_median_ms"] = median(rec["ours"]["runs"]), median(rec["alone_ms"])
        rec["x_alone"] = median([c / a for c, a in zip(rec["ours"]["runs"], rec["alone_ms"])])
        return rec


class DecodeSteps:
    """What one decode step costs as the batch grows from 1 to 3 sequences (the multi-turn run's
    concurrency), and when a fresh prompt's prefill chunk of --mixed-chunk tokens shares the step
    with the 3 (as the scheduler runs it: decodes first, the chunk in the rest of the budget). Each
    is the median of a few steps, all sequences at --prompt-len context."""

    STEPS = 4
    SERIES = ("one_ms", "three_ms", "three_plus_chunk_ms")

    def __init__(self, args, engine: LLMEngine, prompts: list[list[int]]):
        assert len(prompts) >= 3
        self.engine, self.prompts = engine, prompts[:3]
        self.chunks = iter(make_suffixes(engine.tokenizer, args.mixed_chunk))
        self.record = new_record("ms", ["ours"]) | {key: [] for key in self.SERIES} | {"chunk_tokens": args.mixed_chunk}

    def _timed_steps(self, n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            outs = self.engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
            assert not any(o.finish_reason == FinishReason.ERROR for o in outs), outs
        return median(times)

    def measure(self) -> tuple[float, None]:
        engine, rids = self.engine, [f"steps-{next(_ids)}" for _ in range(4)]
        params = SamplingParams(max_tokens=3 * self.STEPS + 8, temperature=0, ignore_eos=True)
        try:
            engine.add_request(rids[0], self.prompts[0], params)
            engine.step()                                   # its prefill
            one = self._timed_steps(self.STEPS)
            for rid, prompt in zip(rids[1:3], self.prompts[1:]):
                engine.add_request(rid, prompt, params)
            engine.step()                                   # their prefills (one step: the budget holds them)
            three = self._timed_steps(self.STEPS)
            engine.add_request(rids[3], next(self.chunks), params)
            mixed = self._timed_steps(1)
        finally:
            for rid in rids:
                engine.abort(rid)
        assert engine.num_free_blocks == engine.num_blocks
        for key, value in zip(self.SERIES, (one, three, mixed)):
            self.record[key].append(value)
        return three, None

    def warm_up(self) -> None:
        self.measure()
        for key in self.SERIES:
            self.record[key].clear()

    def summary(self) -> dict:
        rec = self.record
        for key in self.SERIES:
            rec[key.removesuffix("_ms") + "_median_ms"] = median(rec[key])
        rec["three_x_one"] = median([t / o for t, o in zip(rec["three_ms"], rec["one_ms"])])
        rec["chunk_x_three"] = median([m / t for m, t in zip(rec["three_plus_chunk_ms"], rec["three_ms"])])
        return rec


def new_record(unit: str, sides: list[str]) -> dict:
    fields = ("runs", "loadavg", "cpu_share", "runqueue_wait_share")
    return {"unit": unit, **{side: {f: [] for f in fields} for side in sides}}


def bench_threads(args, engine: LLMEngine, hf, prompts: list[list[int]], threads: int,
                  torch_engine: LLMEngine | None = None) -> dict:
    D, C = args.decode_tokens, args.concurrency
    sides = ["ours"] + (["torch"] if torch_engine is not None else []) + (["hf"] if hf is not None else [])
    single, batch = [prompts[0]], prompts[:C]

    # Each measurement returns (value in its unit, greedy output of the first sequence).
    def decode_measures(decode, overhead: dict | None = None) -> dict:
        """TPOT of one stream and aggregate tokens/s of the batch, for `decode(prompts, n)` of either
        side (ours also records its per-step overhead in `overhead[kind]`)."""
        def extra(kind: str) -> dict:
            return {} if overhead is None else {"overhead_ms": overhead[kind]}

        def tpot_ms():
            _, decode_s, out = decode(single, D, **extra("tpot"))
            return decode_s * 1e3 / (D - 1), out[0]

        def concurrent_tps():
            _, decode_s, out = decode(batch, D, **extra("concurrent"))
            return C * (D - 1) / decode_s, out[0]
        return {"tpot": tpot_ms, "concurrent": concurrent_tps}

    def prefill_ms(which: LLMEngine):
        s, out = ours_prefill(which, single[0])
        return s * 1e3, out

    def hf_prefill_ms():
        prefill_s, _, out = hf_decode(hf, single, 1)
        return prefill_s * 1e3, out[0]

    overhead = {"tpot": [], "concurrent": []}           # ours: ms per decode step outside the forward pass
    fns_of = {"ours": {"prefill": functools.partial(prefill_ms, engine),
                       **decode_measures(functools.partial(ours_decode, engine), overhead)}}
    if torch_engine is not None:
        fns_of["torch"] = {"prefill": functools.partial(prefill_ms, torch_engine),
                           **decode_measures(functools.partial(ours_decode, torch_engine))}
    if hf is not None:
        fns_of["hf"] = {"prefill": hf_prefill_ms, **decode_measures(functools.partial(hf_decode, hf))}
    units = {"prefill": "ms", "tpot": "ms", "concurrent": "tok/s"}
    records = {k: new_record(units[k], sides) for k in units}
    for kind in DECODE_KINDS:
        records[kind]["ours"]["read_gbps_runs"] = []
        records[kind]["ours"]["core_handoff_ns_runs"] = []
    cached = CachedPrefill(args, engine) if args.cached_prefix else None
    steps = DecodeSteps(args, engine, prompts) if args.mixed_chunk and len(prompts) >= 3 else None

    torch.set_num_threads(threads)
    log(f"threads={threads}: warm-up (every measurement once per side; short decodes)")
    # Short decodes, and short prompts for the batch: warming kernels for these shapes needs no
    # full-length prefill of every sequence (minutes on one thread).
    warm_n, warm_batch = min(D, 8), [p[:64] for p in batch]
    for which in [e for e in (engine, torch_engine) if e is not None]:
        ours_prefill(which, single[0]); ours_decode(which, single, warm_n); ours_decode(which, warm_batch, warm_n)
    if hf is not None:
        hf_decode(hf, single, 1); hf_decode(hf, single, warm_n); hf_decode(hf, warm_batch, warm_n)

    for extra in (cached, steps):
        if extra:
            extra.warm_up()
    # A decode figure's floor is set by the memory read rate, which other tenants of a shared machine
    # move by tens of percent within minutes (2 threads here: 34-60 GB/s in one morning). So it is
    # measured right after each decode measurement of ours, on the same threads, and every round's
    # figure is set beside its own floor (limits_of).
    round_reads = RoundReadRates()
    for r in range(args.repeats):
        log(f"threads={threads}: round {r + 1}/{args.repeats}")
        for kind in units:
            fns = {side: fns_of[side][kind] for side in sides}
            ours = records[kind]["ours"]
            after = round_reads.after({"ours": ours["read_gbps_runs"]},
                                      {"ours": ours["core_handoff_ns_runs"]} if threads > 1 else None) \
                if kind in DECODE_KINDS else None
            run_pair(kind, threads, fns, records[kind], r, after)
        if cached:
            run_pair("cached", threads, {"ours": cached.measure}, cached.record, r)
        if steps:
            run_pair("steps", threads, {"ours": steps.measure}, steps.record, r)
    for kind, rec in records.items():
        summarize(rec, higher_is_better=kind == "concurrent")
    for kind, runs in overhead.items():
        records[kind]["ours"]["step_overhead_ms"] = median(runs[-args.repeats:])     # the warm-up's not
    if cached:
        records["cached_prefill"] = cached.summary()
    if steps:
        records["decode_steps"] = steps.summary()
    del round_reads                                     # (its 512 MB, before limits_of probes with its own)

    # Correctness beside speed: greedy tokens of ours vs HF (single stream, same prompt), and ours
    # batched vs ours alone (batch invariance). bf16 kernels differ, so a late divergence can be a
    # near-tie rather than a bug; in float32 they should agree throughout.
    ours_single = records["tpot"]["ours"].pop("last_output")
    ours_batched = records["concurrent"]["ours"].pop("last_output")
    check = {"ours_batched_vs_alone_matching_prefix": _common_prefix(ours_single, ours_batched)}
    if torch_engine is not None:
        check["ours_vs_torch_matching_prefix"] = _common_prefix(ours_single, records["tpot"]["torch"].pop("last_output"))
        check["ours_vs_torch_batched_matching_prefix"] = _common_prefix(
            ours_batched, records["concurrent"]["torch"].pop("last_output"))
        records["prefill"]["torch"].pop("last_output", None)
    if hf is not None:
        check["ours_vs_hf_matching_prefix"] = _common_prefix(ours_single, records["tpot"]["hf"].pop("last_output"))
        check["ours_vs_hf_first_token_equal"] = (records["prefill"]["ours"].pop("last_output")[:1]
                                                 == records["prefill"]["hf"].pop("last_output")[:1])
        records["concurrent"]["hf"].pop("last_output", None)
    records["prefill"]["ours"].pop("last_output", None)
    check["of_tokens"] = D
    records["greedy_check"] = check
    records["limits"] = limits_of(args, engine, threads, records)
    return records


def limits_of(args, engine: LLMEngine, threads: int, records: dict) -> dict:
    """The machine's rates on `threads` threads, and each figure beside its floor (limits.py)."""
    log(f"threads={threads}: limit probe (matmul throughput at the prefill's shapes, memory read bandwidth)")
    work = ModelWork.of(engine.model_config, engine.dtype)
    rates = probe(engine.model_config, engine.dtype, threads, args.prompt_len)
    P, D, C = args.prompt_len, args.decode_tokens, args.concurrency
    context = P + D // 2                                # the mean context over the decode
    figures = {"prefill_ms": (records["prefill"]["ours"]["median"], rates.prefill_floor_s(work, P) * 1e3)}
    decode = {}
    # Throughput as the time of one step of all C sequences, so that every ratio reads "x floor".
    for name, kind, seqs, as_ms in (("tpot_ms", "tpot", 1, lambda v: v),
                                    ("concurrent_step_ms", "concurrent", C, lambda v: C * 1e3 / v)):
        ours = records[kind]["ours"]
        paired = paired_decode_floor(rates, work, seqs, context, [as_ms(v) for v in ours["runs"]],
                                     ours["read_gbps_runs"])
        figures[name] = (as_ms(ours["median"]), paired.floor_ms)
        decode[name] = {"x_floor": round(paired.x_floor, 3), "read_gbps_per_round": ours["read_gbps_runs"],
                        "x_floor_per_round": [round(x, 3) for x in paired.x_per_round]}
        if ours["core_handoff_ns_runs"]:
            decode[name]["core_handoff_ns_per_round"] = ours["core_handoff_ns_runs"]
    if "cached_prefill" in records:
        rec = records["cached_prefill"]
        figures["cached_prefill_ms"] = (rec["ours"]["median"],
                                        rates.prefill_floor_s(work, rec["new_tokens"], rec["prefix_tokens"]) * 1e3)
        figures["new_tokens_alone_ms"] = (rec["alone_median_ms"], rates.prefill_floor_s(work, rec["new_tokens"]) * 1e3)
    matmul, attention = work.prefill_flops(P)
    return {"rates": as_dict(rates),
            "figures": {k: {"measured": round(m, 3), "floor": round(f, 4), "x_floor": round(m / f, 3)} | decode.get(k, {})
                        for k, (m, f) in figures.items()},
            # The prefill's FLOPs over its measured time, as a share of the measured matmul rate.
            "prefill_share_of_matmul_rate": round((matmul + attention) / (records["prefill"]["ours"]["median"] / 1e3)
                                                  / (rates.matmul_gflops * 1e9), 3)}


def make_suffixes(tokenizer, length: int, count: int = 64) -> list[list[int]]:
    """Distinct token runs of `length` (from text other than make_prompts' prompts), one per
    measurement, so no suffix is ever in the prefix cache."""
    text = "\n".join(Path(m.__file__).read_text() for m in (functools, inspect, platform, os.path))
    ids = tokenizer.encode(text)
    while len(ids) < count * length:
        ids = ids + ids[1:]
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def bench_dtypes(args, engines: dict[str, LLMEngine], prompt: list[int]) -> dict:
    """Our engine in float32 vs bfloat16 on 1 thread: prefill and TPOT (justifies the default dtype)."""
    D = args.decode_tokens
    out = {"threads": 1, "prefill": new_record("ms", list(engines)), "tpot": new_record("ms", list(engines))}
    torch.set_num_threads(1)
    log("dtypes-compare: warm-up")
    for e in engines.values():
        ours_prefill(e, prompt); ours_decode(e, [prompt], min(D, 8))
    round_reads, reads = RoundReadRates(), {k: [] for k in engines}     # each TPOT round beside its own floor
    for r in range(args.repeats):
        log(f"dtypes-compare: round {r + 1}/{args.repeats}")
        run_pair("prefill", 1, {k: (lambda e=e: (ours_prefill(e, prompt)[0] * 1e3, None))
                                for k, e in engines.items()}, out["prefill"], r)
        run_pair("tpot", 1, {k: (lambda e=e: (ours_decode(e, [prompt], D)[1] * 1e3 / (D - 1), None))
                             for k, e in engines.items()}, out["tpot"], r, round_reads.after(reads))
    del round_reads
    for kind in ("prefill", "tpot"):
        rec = out[kind]
        for k in engines:
            rec[k]["median"] = median(rec[k]["runs"])
        # bf16 speedup over fp32, per round then median (>1: bf16 faster).
        rec["bf16_speedup_runs"] = [f / b for f, b in zip(rec["float32"]["runs"], rec["bfloat16"]["runs"])]
        rec["bf16_speedup"] = median(rec["bf16_speedup_runs"])
    # Each dtype beside its own floor (its matmul rate, and the bytes it reads): which dtype wins here,
    # and how close each is to what this machine allows it.
    out["floors"] = {}
    for name, e in engines.items():
        log(f"dtypes-compare: limit probe in {name}")
        work, rates = ModelWork.of(e.model_config, e.dtype), probe(e.model_config, e.dtype, 1, len(prompt))
        tpot = paired_decode_floor(rates, work, 1, len(prompt) + D // 2, out["tpot"][name]["runs"], reads[name])
        out["floors"][name] = {"rates": as_dict(rates), "prefill_ms": rates.prefill_floor_s(work, len(prompt)) * 1e3,
                               "tpot_ms": tpot.floor_ms, "tpot_x_floor": round(tpot.x_floor, 3),
                               "read_gbps_per_round": reads[name]}
    return out


def evaluate_goals(args, results: dict) -> list[dict]:
    """One row per goal and thread count: the figure, the target, met or not."""
    goals = []
    for t, rec in results.items():
        t = int(t)
        def add(goal, value, target, met):
            goals.append({"threads": t, "goal": goal, "value": value, "target": target, "met": met})
        if t in REFERENCE["prefill_ms"]:
            target = GOAL_PREFILL_X_REF * REFERENCE["prefill_ms"][t]
            v = rec["prefill"]["ours"]["median"]
            add(f"prefill <= {GOAL_PREFILL_X_REF}x ref ({REFERENCE['prefill_ms'][t]:.0f} ms), ms", v, target,
                v <= target)
            target = GOAL_TPOT_X_REF * REFERENCE["tpot_ms"][t]
            v = rec["tpot"]["ours"]["median"]
            add(f"TPOT <= {GOAL_TPOT_X_REF}x ref ({REFERENCE['tpot_ms'][t]:.0f} ms), ms", v, target, v <= target)
        single_tps = 1e3 / rec["tpot"]["ours"]["median"]
        x = rec["concurrent"]["ours"]["median"] / single_tps
        rec["concurrent"]["ours_x_single_stream"] = x          # recorded in the JSON too
        add(f"{args.concurrency}-way aggregate >= {GOAL_CONCURRENT_X_SINGLE:.0f}x single-stream tok/s, x", x,
            GOAL_CONCURRENT_X_SINGLE, x >= GOAL_CONCURRENT_X_SINGLE)
        for kind, label in (("prefill", "prefill"), ("tpot", "TPOT"), ("concurrent", "aggregate")):
            s = rec[kind].get("speedup_vs_hf")
            add(f"{label} >= {GOAL_X_HF:.1f}x HF (median pairwise), x", s, GOAL_X_HF,
                None if s is None else s >= GOAL_X_HF)
    return goals


def print_report(meta: dict, results: dict, goals: list[dict], dtypes: dict | None) -> None:
    m = meta
    print(f"\nkvhandoff engine benchmark  model={m['model']} dtype={m['dtype']} prompt={m['prompt_len']} "
          f"decode={m['decode_tokens']} concurrency={m['concurrency']} repeats={m['repeats']}")
    print(f"torch {m['torch_version']}  transformers {m['transformers_version']}  commit {m['git_commit']}  "
          f"cpu '{m['cpu']}' ({m['cpu_count']} cpus, affinity {m['cpu_affinity']})  "
          f"block_size={m['block_size']} prefix_caching=off")
    print(f"HF: {m['hf_mode']}")
    if m["model"] != "smollm2" or m["dtype"] != "bfloat16" or m["prompt_len"] != 1024:
        print("note: the reference figures are for smollm2, bf16, 1,024-token prompts; "
              "met / NOT met against them means nothing for this run")
    print()
    C = m["concurrency"]
    head = (f"{'thr':>3}  {'metric':<28} {'ours':>9} {'torch':>9} {'ours/torch':>10} {'HF':>9} {'ours/HF':>8} "
            f"{'reference':>9}  {'load1 min-max':<11} {'wait':>6}")
    print(head + "\n" + "-" * len(head))
    names = {"prefill": f"prefill {m['prompt_len']} tok (ms)", "tpot": "TPOT single-stream (ms)",
             "concurrent": f"{C}-way decode (tok/s)"}
    for t, rec in results.items():
        for kind in ("prefill", "tpot", "concurrent"):
            r = rec[kind]
            hf, tv = r.get("hf", {}).get("median"), r.get("torch", {}).get("median")
            sp, st = r.get("speedup_vs_hf"), r.get("speedup_vs_torch")
            ref = REFERENCE.get(f"{kind}_ms", {}).get(int(t))
            loads = [l[0] for side in SIDES if side in r for l in r[side]["loadavg"]]
            waits = [x for side in SIDES if side in r for x in r[side]["runqueue_wait_share"]]
            wait = None if None in waits else max(waits)
            busy = max(loads) > m["cpu_count"] + 0.5 or (wait or 0) > BUSY_WAIT_SHARE
            print(f"{t:>3}  {names[kind]:<28} {r['ours']['median']:>9.1f} "
                  f"{'-' if tv is None else f'{tv:.1f}':>9} {'-' if st is None else f'{st:.2f}x':>10} "
                  f"{'-' if hf is None else f'{hf:.1f}':>9} {'-' if sp is None else f'{sp:.2f}x':>8} "
                  f"{'-' if ref is None else f'{ref:.0f}':>9}  {min(loads):5.2f}-{max(loads):<5.2f} "
                  f"{'-' if wait is None else f'{wait:.2f}':>6}{'  (busy)' if busy else ''}")
        print(f"     engine overhead per decode step (outside the forward pass): "
              f"{rec['tpot']['ours']['step_overhead_ms']:.2f} ms at 1 sequence, "
              f"{rec['concurrent']['ours']['step_overhead_ms']:.2f} ms at {C}")
        if "cached_prefill" in rec:
            c = rec["cached_prefill"]
            print(f"{t:>3}  {c['new_tokens']} new over {c['prefix_tokens']} cached (ms)  {c['ours']['median']:>9.1f}"
                  f"   alone {c['alone_median_ms']:.1f} ms: x{c['x_alone']:.2f} (median pairwise)")
        if "decode_steps" in rec:
            d = rec["decode_steps"]
            print(f"{t:>3}  decode step (ms): 1 sequence {d['one_median_ms']:.1f}, 3 sequences {d['three_median_ms']:.1f} "
                  f"(x{d['three_x_one']:.2f}), 3 + a {d['chunk_tokens']}-token prefill chunk "
                  f"{d['three_plus_chunk_median_ms']:.1f} (x{d['chunk_x_three']:.2f} of 3 alone)")
        gc_ = rec["greedy_check"]
        print(f"     greedy check, leading tokens equal of {gc_['of_tokens']}: ours vs HF "
              f"{gc_.get('ours_vs_hf_matching_prefix', 'n/a')}, ours vs torch paths "
              f"{gc_.get('ours_vs_torch_matching_prefix', 'n/a')} (batched "
              f"{gc_.get('ours_vs_torch_batched_matching_prefix', 'n/a')}), ours batched vs alone "
              f"{gc_['ours_batched_vs_alone_matching_prefix']}")
    print(f"  ours: kernels {m['kernels']}; torch: the same engine on torch's paths (cpu_kernels=False).")
    print("  ours/torch, ours/HF: median of per-round speedups (>1: ours faster). wait: the most any run's threads spent "
          "waiting for a core (share of run time);\n  (busy): load average above the core count or wait above "
          f"{BUSY_WAIT_SHARE}: other work shared the cores, treat the row as noise.\n")
    print("the machine's limits (limits.py): measured rates, and each figure beside its floor")
    head = f"{'thr':>3}  {'figure':<24} {'measured':>9} {'floor':>9} {'x floor':>8}"
    print(head + "\n" + "-" * len(head))
    for t, rec in results.items():
        lim = rec["limits"]
        r = lim["rates"]
        print(f"{t:>3}  rates: {r['dtype']} matmul {r['matmul_gflops']:.1f} GFLOP/s at the prefill's shapes, "
              f"memory read {r['read_gbps']:.1f} GB/s; the prefill ran at {lim['prefill_share_of_matmul_rate']:.2f}x "
              f"the matmul rate")
        for name, f in lim["figures"].items():
            per_round = f.get("read_gbps_per_round")
            rounds = "" if not per_round else \
                f"   read {min(per_round):.1f}-{max(per_round):.1f} GB/s beside its rounds"
            handoffs = f.get("core_handoff_ns_per_round")
            if handoffs:
                rounds += f", a line between cores {' / '.join(f'{ns:.0f}' for ns in handoffs)} ns"
            print(f"{t:>3}  {name:<24} {f['measured']:>9.1f} {f['floor']:>9.1f} {f['x_floor']:>7.2f}x{rounds}")
    print("  floors: prefill = (matmul + attention FLOPs) / matmul rate; a decode step = the larger of (weights + "
          "every sequence's K/V) / read bandwidth\n  and its FLOPs / matmul rate; concurrent_step_ms = the time "
          "one step of all sequences took. A decode figure's read rate is\n  measured right after each of its "
          "rounds: x floor is the median of the rounds' own ratios, floor the median of their floors.\n"
          "  On two threads, so is how long a cache line took from one core to the other: ~30-50 ns where they "
          "share an L3, ~170 ns\n  where a VM's vCPUs sit on two CCDs (the host moves them within minutes; "
          "two threads' steps differ with it).\n")
    head = f"{'thr':>3}  {'goal':<58} {'value':>8} {'target':>8}  met"
    print(head + "\n" + "-" * len(head))
    for g in goals:
        v = "-" if g["value"] is None else f"{g['value']:.2f}"
        met = "n/a (--no-hf)" if g["met"] is None else ("met" if g["met"] else "NOT met")
        print(f"{g['threads']:>3}  {g['goal']:<58} {v:>8} {g['target']:>8.2f}  {met}")
    if dtypes:
        print("\nour engine, float32 vs bfloat16, 1 thread (bf16 speedup = fp32 time / bf16 time, median pairwise):")
        for kind, label in (("prefill", f"prefill {m['prompt_len']} tok (ms)"), ("tpot", "TPOT (ms)")):
            r = dtypes[kind]
            sides = []
            for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
                ms, floor = r[dtype]["median"], dtypes["floors"][dtype][f"{kind}_ms"]
                x_floor = dtypes["floors"][dtype].get(f"{kind}_x_floor", ms / floor)     # TPOT: per round
                sides.append(f"{short} {ms:9.1f} ({x_floor:.2f}x its floor {floor:.1f})")
            print(f"     {label:<24} {'  '.join(sides)}  bf16 speedup {r['bf16_speedup']:.2f}x")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m kvhandoff.bench.engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="alias (smollm2, tiny) or path")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="auto: the engine's own choice for this CPU (what a server runs)")
    p.add_argument("--device", default="cpu", help="cpu (the measured setting) or cuda")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cached-prefix", type=int, default=1792,
                   help="prefill over a cached prefix of this many tokens (0: skip the measurement)")
    p.add_argument("--cached-new", type=int, default=328, help="new tokens after the cached prefix")
    p.add_argument("--mixed-chunk", type=int, default=300,
                   help="decode steps of 1 and 3 sequences, then of the 3 with a fresh prefill chunk of this "
                        "many tokens (0: skip)")
    p.add_argument("--json", metavar="FILE", help="write every figure here")
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face transformers")
    p.add_argument("--no-torch-paths", action="store_true",
                   help="skip the A/B against our engine on torch's paths only (cpu_kernels=False)")
    p.add_argument("--dtypes-compare", action="store_true",
                   help="also measure our engine in float32 vs bfloat16 (prefill, TPOT; 1 thread)")
    args = p.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",") if t.strip()]
    if args.decode_tokens < 2 or args.prompt_len < 1 or args.concurrency < 1 or args.repeats < 1:
        p.error("need --decode-tokens >= 2 and positive --prompt-len, --concurrency, --repeats")
    return args


def make_engine(args, dtype: str, cpu_kernels: bool = True) -> LLMEngine:
    C, P, D = args.concurrency, args.prompt_len, args.decode_tokens
    block_size = EngineConfig.block_size
    blocks_per_seq = -(-(P + D) // block_size)
    cached_len = args.cached_prefix + args.cached_new
    # Room for the cached measurement too: its prefix stays cached while the new tokens are computed.
    cached_blocks = 2 * -(-cached_len // block_size) if args.cached_prefix else 0
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=dtype, device=args.device, threads=args.threads[0], cpu_kernels=cpu_kernels,
        enable_prefix_caching=False,                # repeats reuse the prompt: a cache hit would skip prefill
        # Every prefill one-shot, so the decode phase is pure decode.
        max_num_batched_tokens=max(C * P, cached_len),
        # DecodeSteps runs 3 sequences and a fresh chunk at once.
        max_num_seqs=max(C, 4), num_blocks=max(C, 3) * blocks_per_seq + cached_blocks
        + -(-(args.mixed_chunk + 32) // block_size) + 8))
    engine.runner.wait_populated()              # its pool's pages, committed beside us, not while we time
    return engine


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    log(f"loading our engine ({args.model}, {args.dtype})")
    engine = make_engine(args, args.dtype)
    hf, hf_mode, transformers_version, attn = None, "skipped (--no-hf)", None, None
    if not args.no_hf:
        import transformers
        transformers_version = transformers.__version__
        log(f"loading HF transformers {transformers_version} from {engine.loaded.path}")
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            engine.loaded.path, dtype=engine.dtype).to(engine.device).eval()
        attn = getattr(hf.config, "_attn_implementation", None)
        hf_mode = (f"manual greedy loop over model.forward with DynamicCache (= generate's forwards), "
                   f"logits_to_keep=1, inference_mode, attn_implementation={attn}; "
                   f"concurrent: one batch of {args.concurrency} equal-length prompts, no padding")
    torch_engine = None
    if not args.no_torch_paths and engine.kernels.startswith("on"):
        log("loading our engine again on torch's paths only (cpu_kernels=False), the A/B for the kernels")
        torch_engine = make_engine(args, args.dtype, cpu_kernels=False)
    prompts = make_prompts(engine.tokenizer, args.concurrency, args.prompt_len)

    meta = {
        "model": args.model, "model_path": str(engine.loaded.path), "dtype": str(engine.dtype).removeprefix("torch."),
        "dtype_reason": engine.dtype_reason,
        "device": str(engine.device), "threads": args.threads, "repeats": args.repeats, "kernels": engine.kernels,
        "torch_paths_side": torch_engine is not None,
        "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens, "concurrency": args.concurrency,
        "block_size": engine.block_size, "prefix_caching": False, "torch_version": torch.__version__,
        "transformers_version": transformers_version, "hf_mode": hf_mode, "hf_attn_implementation": attn,
        "git_commit": git_commit(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(), "prompt_source": "stdlib sources (argparse, textwrap, json.decoder, "
        "statistics) tokenized, cut into equal-length prompts", "sampling": "greedy, ignore_eos",
        "reference": {k: {str(t): v for t, v in d.items()} for k, d in REFERENCE.items()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
    }
    results = {}
    for t in args.threads:
        results[str(t)] = bench_threads(args, engine, hf, prompts, t, torch_engine)
    goals = evaluate_goals(args, results)

    dtypes = None
    if args.dtypes_compare:
        log("dtypes-compare: loading our engine in the other dtype(s)")
        engines = {d: engine if d == str(engine.dtype).removeprefix("torch.") else make_engine(args, d)
                   for d in ("float32", "bfloat16")}
        dtypes = bench_dtypes(args, engines, prompts[0])

    meta["duration_s"] = round(time.time() - started, 1)
    print_report(meta, results, goals, dtypes)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "goals": goals,
                                               "dtypes_compare": dtypes}, indent=2))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
