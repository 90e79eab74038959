"""Prefill through torch against prefill row by row through the decode kernels (issue 25), side by side.

`python -m kvhandoff.bench.prefill_paths --model smollm2 --dtypes bfloat16,float32 --threads 1,2
--lengths 256,1024,2048 --repeats 5`

Row by row (llama.ROW_WISE_PREFILL), every prompt token goes through FusedDecode as a decode row whose
context ends at its own position: one function computes every token, so a token's logits and K/V do
not depend on what shares its step, how its prompt was chunked, or whether it is recomputed after a
preemption (batch invariance). On torch's path a bf16 prompt's activations are bf16 between ops
and its attention runs by blocks of queries, unlike the decode rows. For each dtype, thread count and
prompt length this prints the median prefill time of both paths (alternated, in one process) and
their ratio, and whether the greedy continuation of one prompt is the same alone and beside others.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import kvhandoff.model.llama as llama
from kvhandoff.bench.engine import make_prompts
from kvhandoff.bench.meta import cpu_model, git_commit, log, median
from kvhandoff.config import EngineConfig
from kvhandoff.engine.engine import LLMEngine
from kvhandoff.engine.request import SamplingParams

PATHS = {"torch": False, "rows": True}
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def timed_prefill(engine: LLMEngine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    engine.generate([prompt], ONE)
    return (time.perf_counter() - t0) * 1e3


def measure(engine: LLMEngine, prompts: list[list[int]], threads: int, repeats: int) -> dict:
    """Median prefill ms of each path for one prompt length, rounds alternating which path goes first."""
    torch.set_num_threads(threads)
    runs = {path: [] for path in PATHS}
    for path, flag in PATHS.items():        # warm-up
        llama.ROW_WISE_PREFILL = flag
        timed_prefill(engine, prompts[0])
    for r in range(repeats):
        for path in (list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]):
            llama.ROW_WISE_PREFILL = PATHS[path]
            runs[path].append(timed_prefill(engine, prompts[0]))
    medians = {path: median(v) for path, v in runs.items()}
    return {"runs_ms": runs, "median_ms": medians, "rows_over_torch": medians["rows"] / medians["torch"]}


def invariance(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> dict:
    """Per path: is each prompt's greedy continuation the same alone as with the others beside it?"""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    result = {}
    for path, flag in PATHS.items():
        llama.ROW_WISE_PREFILL = flag
        alone = [engine.generate([p], params)[0] for p in prompts]
        together = engine.generate(prompts, params)
        result[path] = sum(a == b for a, b in zip(alone, together))
    result["of"] = len(prompts)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--lengths", default="256,1024,2048")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-batched-tokens", type=int, default=0,
                   help="the engine's step budget (0: every prompt in one step; serving's default is 512)")
    p.add_argument("--check-prompts", type=int, default=4, help="prompts for the alone/together check (0: skip)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    results = {"cpu": cpu_model(), "commit": git_commit(), "model": args.model, "figures": [],
               "max_batched_tokens": args.max_batched_tokens or None}
    log(f"prefill paths on {results['cpu']}, {args.model}, commit {results['commit']}, step budget "
        f"{args.max_batched_tokens or 'the whole prompt'}")
    for dtype in args.dtypes.split(","):
        engine = LLMEngine(EngineConfig(model=args.model, dtype=dtype, enable_prefix_caching=False,
                                        max_num_batched_tokens=args.max_batched_tokens
                                        or max(lengths) * max(1, args.check_prompts),
                                        max_num_seqs=max(4, args.check_prompts)))
        engine.runner.wait_populated()          # its pool's pages, committed beside us, not while we time
        if engine.loaded.model.fused_decode is None:
            log(f"{dtype}: no fused decode kernels here ({engine.kernels}): skipped")
            continue
        for threads in (int(t) for t in args.threads.split(",")):
            for length in lengths:
                prompts = make_prompts(engine.tokenizer, 1, length)
                figure = {"dtype": dtype, "threads": threads, "prompt_tokens": length,
                          **measure(engine, prompts, threads, args.repeats)}
                results["figures"].append(figure)
                m = figure["median_ms"]
                log(f"{dtype:<9} threads={threads} {length:5d} tokens: torch {m['torch']:8.1f} ms, rows "
                    f"{m['rows']:8.1f} ms, rows/torch {figure['rows_over_torch']:.2f}")
        if args.check_prompts:
            torch.set_num_threads(1)
            prompts = make_prompts(engine.tokenizer, args.check_prompts, min(lengths))
            check = invariance(engine, prompts, 32)
            results.setdefault("invariance", {})[dtype] = check
            log(f"{dtype}: greedy 32 tokens the same alone and {args.check_prompts} together: "
                f"torch path {check['torch']}/{check['of']}, rows {check['rows']}/{check['of']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
