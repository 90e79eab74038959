"""`kvhandoff bench`: send a workload to an OpenAI-compatible endpoint and report what the client saw.

Talks HTTP only (it measures other serving systems as well as ours). A run is one or more *points*
(a mode and a load), each a workload sent against a base URL: items leave at their arrival offsets
(multi-turn items after their previous turn's answer and think time), every request is streamed and
timed from the outside (client.py), and the server's `timings` / `handoff` objects ride along. Nothing
is dropped: a request that fails is a row with its error, counted in the summary.

Outputs in --out: results.jsonl (one row per request), summary.json (what was measured and the
statistics per point), summary.md (the same as tables).
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from kvhandoff.bench import plots
from kvhandoff.bench.client import (
    RequestResult,
    chat_body,
    completion_body,
    percentile,
    stream_completion,
)
from kvhandoff.bench.meta import cpu_model, fmt, git_commit, log
from kvhandoff.bench.workload import WorkItem
from kvhandoff.wire.messages import PHASES


@dataclass
class Point:
    """One measured configuration: a mode (or target) and a load."""
    label: str                      # e.g. "push@0.50"
    mode: str                       # the stack's mode, or "target"
    url: str
    rate: float | None              # requests/s of the arrivals (None: replayed offsets)
    items: list[WorkItem]
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    started_at: float = 0.0         # perf_counter when its first item was due
    server: dict | None = None      # the target's /health when the point started (what it was running)
    cpu_s: dict[str, float] | None = None   # a launched stack's CPU seconds per role over the point
    router_cpu_s: float | None = None       # its router's CPU over the point, to the ns (schedstat) ...
    router_idle_cpu_s_per_s: float | None = None   # ... and per second with nothing in flight, just before
    timeline: list = field(default_factory=list)    # (s, {decode worker: sequences}) sampled from the router
    retained: list = field(default_factory=list)    # (s, {decode worker: bytes of retained KV}), likewise


async def run_point(client: aiohttp.ClientSession, point: Point, model: str) -> None:
    """Send every item of the point at its time; fill point.results in item order."""
    results: list[RequestResult | None] = [None] * len(point.items)
    answered = [asyncio.Event() for _ in point.items]
    histories: list[list[dict] | None] = [None] * len(point.items)
    t0 = point.started_at = time.perf_counter()
    done = 0
    bar = tqdm(total=len(point.items), desc=point.label, unit="req", file=sys.stderr, disable=None, leave=True)

    async def one(index: int, item: WorkItem) -> None:
        nonlocal done
        if item.after is None:
            await asyncio.sleep(max(0.0, t0 + item.offset_s - time.perf_counter()))
            history = list(item.messages or [])
        else:
            await answered[item.after].wait()
            await asyncio.sleep(item.think_s)
            prev = results[item.after]
            history = (histories[item.after] or []) + [{"role": "assistant", "content": prev.text}] + \
                (item.messages or [])
        histories[index] = history
        if item.messages is not None:
            body = chat_body(model, history, item.max_tokens)
        else:
            body = completion_body(model, item.prompt, item.max_tokens)
        headers = {"X-Session-Id": item.session_id} if item.session_id else None
        result = await stream_completion(client, point.url, body, headers)
        results[index] = result
        answered[index].set()
        done += 1
        failed = sum(1 for r in results if r is not None and not r.ok)
        bar.update(1)
        if failed:
            bar.set_postfix(failed=failed)
        if bar.disable and (done == len(point.items) or done % max(1, len(point.items) // 10) == 0):
            log(f"  {point.label}: {done}/{len(point.items)} done" + (f", {failed} failed" if failed else ""))

    try:
        await asyncio.gather(*(one(i, item) for i, item in enumerate(point.items)))
    finally:
        bar.close()
    point.wall_s = time.perf_counter() - t0
    point.results = [r for r in results if r is not None]


def result_row(point: Point, index: int, item: WorkItem, r: RequestResult) -> dict:
    itl = [b - a for a, b in zip(r.token_times_ms, r.token_times_ms[1:])]
    return {"point": point.label, "mode": point.mode, "rate": point.rate, "index": index,
            "target_tokens": item.target_tokens, "session_id": item.session_id, "think_s": item.think_s, **item.tags,
            "ok": r.ok, "error": r.error, "sent_s": round(r.sent_at - point.started_at, 6) if r.sent_at else None,
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
            "ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms, "e2e_ms": r.e2e_ms,
            "itl_ms": [round(x, 3) for x in itl], "timings": r.timings, "handoff": r.handoff}


def stats(values: list[float | None]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean": statistics.fmean(values), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


def summarize(point: Point, rows: list[dict], slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict:
    ok = [r for r in rows if r["ok"]]
    good = [r for r in ok if (slo_ttft_ms is None or r["ttft_ms"] <= slo_ttft_ms)
            and (slo_tpot_ms is None or (r["tpot_ms"] or 0) <= slo_tpot_ms)]
    phases = {p: stats([((r["handoff"] or {}).get("phases_ms") or {}).get(p) for r in ok]) for p in PHASES}
    return {
        "label": point.label, "mode": point.mode, "rate": point.rate, "requests": len(rows),
        "completed": len(ok), "failed": len(rows) - len(ok),
        "errors": sorted({r["error"] for r in rows if not r["ok"]})[:5],
        "wall_s": point.wall_s, "throughput_req_s": len(ok) / point.wall_s if point.wall_s else None,
        "output_tokens": sum(r["output_tokens"] for r in ok),
        "ttft_ms": stats([r["ttft_ms"] for r in ok]), "tpot_ms": stats([r["tpot_ms"] for r in ok]),
        "itl_ms": stats([x for r in ok for x in r["itl_ms"]]), "e2e_ms": stats([r["e2e_ms"] for r in ok]),
        "goodput": {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "good": len(good),
                    "share": len(good) / len(rows) if rows else None,
                    "req_s": len(good) / point.wall_s if point.wall_s else None},
        "phases_ms": {p: s for p, s in phases.items() if s["n"]},
        "cpu_s": point.cpu_s,
        # What routing costs: the router's CPU per request, less what it spends idle over as long
        # (health polls), measured just before the point.
        "router_cpu_ms_per_request": router_cpu_ms_per_request(point, len(rows)),
        "router_idle_cpu_ms_per_s": (round(point.router_idle_cpu_s_per_s * 1e3, 3)
                                     if point.router_idle_cpu_s_per_s is not None else None),
        "moved_late": sum(1 for r in ok if (r["handoff"] or {}).get("rebound_from")),
        "decode_imbalance": imbalance(point.timeline), "timeline": point.timeline,
        "retention": retention(point.retained, ok), "turns": turns(ok), "server": point.server,
    }


def goodput_words(slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> str:
    bounds = [f"{name} <= {value:g} ms" for name, value in (("TTFT", slo_ttft_ms), ("TPOT", slo_tpot_ms))
              if value is not None]
    if not bounds:
        return "Goodput: no SLO was set (--slo-ttft-ms, --slo-tpot-ms), so it is the share of requests completed."
    return f"Goodput: share of requests completed meeting {' and '.join(bounds)}."


def router_cpu_ms_per_request(point: Point, requests: int) -> float | None:
    """The router's CPU over the point less what it spends idle over as long (health polls): what the
    requests themselves cost it, each."""
    if point.router_cpu_s is None or not requests:
        return None
    idle = (point.router_idle_cpu_s_per_s or 0.0) * (point.wall_s or 0.0)
    return 1e3 * max(0.0, point.router_cpu_s - idle) / requests


def turns(rows: list[dict]) -> list[dict] | None:
    """Multi-turn points, turn by turn: TTFT, and where the prompt's KV came from (means, tokens): the
    prefill worker's own prefix cache, a fetch from the decode worker that retained it, or computed;
    the router's choices (route_decision: cache, fetch, recompute) and how good its estimate of the
    chosen way was (median of measured / estimated ms)."""
    by_turn: dict[int, list[dict]] = {}
    for r in rows:
        if r.get("turn"):
            by_turn.setdefault(r["turn"], []).append(r)
    out = []
    for turn, group in sorted(by_turn.items()):
        handoffs = [r["handoff"] or {} for r in group]
        cached = [h.get("prefill_cached_tokens") or 0 for h in handoffs]
        fetched = [h.get("reused_tokens") or 0 for h in handoffs]
        out.append({"turn": turn, "n": len(group), "ttft_p50": percentile([r["ttft_ms"] for r in group], 50),
                    "prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in group),
                    "cached_tokens": statistics.fmean(cached), "fetched_tokens": statistics.fmean(fetched),
                    "computed_tokens": statistics.fmean(r["prompt_tokens"] - c - f
                                                        for r, c, f in zip(group, cached, fetched)),
                    "choices": dict(Counter((h.get("route_decision") or {}).get("choice") or "-" for h in handoffs)),
                    "estimate_ratio": route_estimate_ratio(handoffs)})
    return out or None


def route_estimate_ratio(handoffs: list[dict]) -> float | None:
    """Median of measured / estimated ms of the way the router chose (None: it chose nothing)."""
    ratios = []
    for h in handoffs:
        decision = h.get("route_decision") or {}
        chosen = next((c for c in decision.get("candidates") or [] if c.get("url") == decision.get("prefill_worker")), None)
        if chosen and chosen.get("est_ms") and decision.get("measured_ms") is not None:
            ratios.append(decision["measured_ms"] / chosen["est_ms"])
    return statistics.median(ratios) if ratios else None


def retention(samples: list, rows: list[dict]) -> dict | None:
    """Bidirectional reuse's economics over a point: the decode workers' retained KV over time (sampled
    from the router's /health) as GiB-seconds, its peak and mean; of the turns that named a retained
    history, the share that fetched it (hit rate); tokens and bytes read back."""
    decision = lambda r: (r["handoff"] or {}).get("reuse_decision") or {}
    named = [r for r in rows if decision(r) and decision(r).get("reason") != "no retained history named"]
    totals = [(t, sum(by_worker.values())) for t, by_worker in samples]
    if not named and not any(b for _, b in totals):
        return None
    # Of the turns that could have reused a history (a conversation's later turns; else those that
    # named one), how many fetched it: an expired or evicted history is a miss too.
    later = [r for r in rows if (r.get("turn") or 0) > 1] or named
    held = sum((t2 - t1) * b1 for (t1, b1), (t2, _) in zip(totals, totals[1:]))
    return {"gib_s": held / 2**30, "peak_mib": max((b for _, b in totals), default=0) / 2**20,
            "mean_mib": statistics.fmean(b for _, b in totals) / 2**20 if totals else 0.0,
            "turns_with_history": len(named), "later_turns": len(later),
            "hit_rate": sum(decision(r).get("decision") == "fetch" for r in later) / len(later) if later else None,
            "reused_tokens": sum((r["handoff"] or {}).get("reused_tokens") or 0 for r in rows),
            "reverse_mib": sum((r["handoff"] or {}).get("reverse_bytes") or 0 for r in rows) / 2**20}


def imbalance(timeline: list) -> dict | None:
    """How unevenly the decode workers were loaded: per sample, the most sequences on one worker less
    the fewest on another; its mean and p90 over the point."""
    spreads = [max(load.values()) - min(load.values()) for _, load in timeline if len(load) > 1]
    if not spreads:
        return None
    return {"samples": len(spreads), "mean": statistics.fmean(spreads), "p90": percentile(spreads, 90)}


def markdown(meta: dict, summaries: list[dict]) -> str:
    lines = [f"# kvhandoff bench: {meta['workload']} on {meta['target']}", "",
             f"model `{meta['model']}`, kvhandoff {meta['kvhandoff_version']} ({meta['git_commit']}), "
             f"{meta['cpu']} ({meta['cores']} cores), seed {meta['seed']}, started {meta['started']}", "",
             "| point | rate req/s | requests | failed | done req/s | TTFT p50 | p90 | p99 | TPOT p50 | p90 | p99 "
             "| e2e p50 | goodput |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        t, p, e, g = s["ttft_ms"], s["tpot_ms"], s["e2e_ms"], s["goodput"]
        lines.append(f"| {s['label']} | {fmt(s['rate'], '.3f')} | {s['requests']} | {s['failed']} | "
                     f"{fmt(s['throughput_req_s'], '.3f')} | "
                     f"{fmt(t.get('p50'))} | {fmt(t.get('p90'))} | {fmt(t.get('p99'))} | {fmt(p.get('p50'), '.2f')} | "
                     f"{fmt(p.get('p90'), '.2f')} | {fmt(p.get('p99'), '.2f')} | {fmt(e.get('p50'), '.0f')} | "
                     f"{fmt(g['share'], '.0%')} |")
    phased = [s for s in summaries if s["phases_ms"]]
    if phased:
        lines += ["", "Handoff phases, p50 ms (from the server's `handoff` objects):", "",
                  "| point | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
        for s in phased:
            lines.append(f"| {s['label']} | " + " | ".join(fmt(s["phases_ms"].get(p, {}).get("p50")) for p in PHASES)
                         + " |")
    costed = [s for s in summaries if s.get("cpu_s")]
    if costed:
        lines += ["", "CPU seconds per process role over each point (the stack's own processes), and what "
                  "routing cost per request (the router's CPU over the point, less its idle rate measured "
                  "for a second just before times the point's length, per request):", "",
                  "| point | router ms/request | moved (late binding) | decode imbalance mean / p90 | CPU s by role |",
                  "|---|---|---|---|---|"]
        for s in costed:
            by_role = ", ".join(f"{role} {sec:.2f}" for role, sec in sorted(s["cpu_s"].items()))
            spread = s.get("decode_imbalance") or {}
            lines.append(f"| {s['label']} | {fmt(s['router_cpu_ms_per_request'], '.2f')} | {s['moved_late']} | "
                         f"{fmt(spread.get('mean'), '.1f')} / {fmt(spread.get('p90'), '.1f')} | {by_role} |")
    kept = [s for s in summaries if s.get("retention")]
    if kept:
        lines += ["", "Bidirectional reuse: decode workers' retained KV (sampled from the router every 0.5 s) "
                  "against what it saved:", "",
                  "| point | GiB-s held | peak MiB | mean MiB | turns with history | hit rate | reused tokens "
                  "| MiB read back |", "|---|---|---|---|---|---|---|---|"]
        for s in kept:
            k = s["retention"]
            lines.append(f"| {s['label']} | {k['gib_s']:.4f} | {k['peak_mib']:.1f} | {k['mean_mib']:.1f} | "
                         f"{k['turns_with_history']} | {fmt(k['hit_rate'], '.0%')} | {k['reused_tokens']} | "
                         f"{k['reverse_mib']:.1f} |")
    turned = [s for s in summaries if s.get("turns")]
    if turned:
        lines += ["", "Turn by turn: TTFT p50 ms, and the prompt's tokens (means) served by the prefill worker's own "
                  "prefix cache / fetched from a decode worker / computed; the router's choices, and its estimate "
                  "of the chosen way's ms against what was measured (median measured / estimated):", "",
                  "| point | turn | n | TTFT p50 | prompt | cached | fetched | computed | choices | measured / est. |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for s in turned:
            for t in s["turns"]:
                choices = ", ".join(f"{k} {v}" for k, v in sorted(t["choices"].items()))
                lines.append(f"| {s['label']} | {t['turn']} | {t['n']} | {fmt(t['ttft_p50'])} | "
                             f"{t['prompt_tokens']:.0f} | {t['cached_tokens']:.0f} | {t['fetched_tokens']:.0f} | "
                             f"{t['computed_tokens']:.0f} | {choices} | {fmt(t.get('estimate_ratio'), '.2f')} |")
    if meta.get("plots"):
        lines += ["", "Plots: " + ", ".join(f"[{name}]({name})" for name in meta["plots"])]
    slo = summaries[0]["goodput"] if summaries else {}
    lines += ["", "Times in ms as the client saw them (TTFT: request sent -> first streamed token). "
              + goodput_words(slo.get("slo_ttft_ms"), slo.get("slo_tpot_ms"))]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, meta: dict, points: list[Point], slo_ttft_ms, slo_tpot_ms) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    summaries, all_rows = [], []
    with open(out / "results.jsonl", "w") as f:
        for point in points:
            rows = [result_row(point, i, item, r) for i, (item, r) in enumerate(zip(point.items, point.results))]
            for row in rows:
                f.write(json.dumps(row) + "\n")
            summaries.append(summarize(point, rows, slo_ttft_ms, slo_tpot_ms))
            all_rows += rows
    meta["plots"] = plots.draw(out, summaries, all_rows)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "points": summaries}, indent=1))
    (out / "summary.md").write_text(markdown(meta, summaries))
    return summaries


def run_meta(args, model: str, target: str, started: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version
    try:
        kv_version = version("kvhandoff")
    except PackageNotFoundError:
        kv_version = "unknown"
    return {"workload": args.workload, "target": target, "model": model, "seed": args.seed,
            "kvhandoff_version": kv_version, "git_commit": git_commit(), "cpu": cpu_model(),
            "cores": len(os.sched_getaffinity(0)), "started": started,
            "argv": sys.argv[1:], "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                             if k not in ("func", "extra")}}
