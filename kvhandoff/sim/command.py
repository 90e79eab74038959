"""`kvhandoff simulate`: calibrate the fleet model on a real bench run, show that it reproduces that run,
then (given rates) run it on fleets and loads real hardware here cannot reach.

    kvhandoff simulate --calibrate bench-out [--point LABEL]                 # reproduce the run
    kvhandoff simulate --calibrate bench-out --prefill 8 --decode 32 --rates 50,100,200 \\
        --policies round-robin,load --bindings early,late,late-bound [--requests 2000] [--seed 0]

    kvhandoff simulate --calibrate bench-out --prefill 8 --decode 32 --rates 50,100 --bindings early,late \
        --links free,10gbit,1gbit --transfer layerwise --output-cv 0,1,2         # where each binding wins

    kvhandoff simulate --calibrate bench-out --prefill 500 --decode 500 --rates 500,1000 \
        --router-costs router-bench/results.json --routers 1,2,4                    # the routers' own cost

The first form replays the calibration point's own arrivals and lengths on its own fleet and prints
each phase's median, real against simulated. The second prints TTFT and TPOT p50/p90/p99, goodput
and late-binding moves per (link, output-length spread, rate, policy, binding), and with more than
one binding the best one per point. `--json FILE` writes everything. With `--router-costs` (the
results.json of `python -m kvhandoff.bench.router --workers N`) the routers are in the model too: it
prints the requests/s `--routers` routers can decide for this fleet, and each point is simulated
behind each number of routers (fleet.RouterCosts: a router's decision, the events every router
absorbs, its polls).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvhandoff.launch.netlink import LinkSpec
from kvhandoff.sim.calibrate import Costs, computed_tokens, fit, load_run, phase, usable
from kvhandoff.sim.fleet import BINDINGS, POLICIES, Fleet, Job, Link, RouterCosts, Routing, poisson_jobs

COMPARED = ("prefill_queue", "prefill_compute", "transfer", "ttft", "tpot")
TOLERANCE = 0.15            # issue 14: the fitted costs reproduce the calibration run's medians within 15%
ABS_FLOOR_MS = 1.0          # ... or within this, for phases of a millisecond or less (15% of 0.2 ms is noise)
FREE = "free"               # --links: the transfer as the calibration run measured it


def value(row: dict, name: str) -> float | None:
    """A simulated or a real row's TTFT, TPOT or phase (the real one's phases are in its handoff object)."""
    if name in ("ttft", "tpot"):
        return row.get(f"{name}_ms")
    return (row.get("phases_ms") or {}).get(name) if "phases_ms" in row else phase(row, name)


def percentile(values: list[float], q: float) -> float | None:
    import numpy        # (not at import: `kvhandoff --help` builds this command's parser)
    return float(numpy.percentile(values, q)) if values else None


def fmt_cv(cv: float | None) -> str:
    return "run" if cv is None else f"{cv:g}"


REPLAYS = 16                # the replay's own draws: pooled over this many seeds, so its median is not a sample's


def reproduce(costs: Costs, rows: list[dict], seed: int = 0, layers: int = 30) -> dict:
    """Replay the calibration point on its own fleet (behind its link, if it had one): medians per
    phase, real and simulated."""
    real = sorted((r for r in rows if r["point"] == costs.label and usable(r)), key=lambda r: r["sent_s"])
    simulated = []
    for k in range(REPLAYS):
        jobs = [Job(i, r["sent_s"], r["prompt_tokens"], r["output_tokens"], computed_tokens(r)) for i, r in enumerate(real)]
        simulated += Fleet(costs, len(costs.prefill_workers), len(costs.decode_workers), seed=seed + k,
                           link=Link(costs.link_bits_per_s, costs.mode == "push-layerwise", layers)).run(jobs)
    out = {}
    for name in COMPARED:
        got = statistics.median(v for s in simulated if (v := value(s, name)) is not None)
        want = statistics.median(v for r in real if (v := value(r, name)) is not None)
        error = abs(got - want)
        out[name] = {"real_ms": want, "sim_ms": got, "error": error / want if want else None,
                     "within": error <= max(TOLERANCE * want, ABS_FLOOR_MS)}
    return out


def scaled(costs: Costs, args) -> list[dict]:
    points = []
    for link_name in args.links:
        link = Link(None if link_name == FREE else LinkSpec.parse(link_name).bits_per_s, args.transfer == "layerwise",
                    args.layers)
        for cv in args.output_cv:
            for rate in args.rates:
                jobs = poisson_jobs(costs, rate, args.requests, args.seed, cv)
                for routers in args.routers:
                    routing = Routing(args.router_costs, routers, rate) if args.router_costs else None
                    for policy in args.policies:
                        for binding in args.bindings:
                            fleet = Fleet(costs, args.prefill, args.decode, policy, binding, args.poll_s, args.seed,
                                          link, routing=routing)
                            done = fleet.run([Job(j.index, j.arrival_s, j.prompt_tokens, j.output_tokens,
                                                  j.computed_tokens) for j in jobs])
                            points.append({"link": link_name, "output_cv": cv, "rate": rate, "policy": policy,
                                           "binding": binding, "routers": routers if routing else None,
                                           **measures(done, args)})
    return points


def measures(done: list[dict], args) -> dict:
    ttft, tpot = [d["ttft_ms"] for d in done], [d["tpot_ms"] for d in done if d["tpot_ms"] is not None]
    good = sum(1 for d in done if (args.slo_ttft_ms is None or d["ttft_ms"] <= args.slo_ttft_ms)
               and (args.slo_tpot_ms is None or (d["tpot_ms"] or 0) <= args.slo_tpot_ms))
    return {"requests": len(done), **{f"ttft_p{q}_ms": percentile(ttft, q) for q in (50, 90, 99)},
            **{f"tpot_p{q}_ms": percentile(tpot, q) for q in (50, 90, 99)},
            "goodput": good / len(done), "moved": sum(1 for d in done if d["moved_from"] is not None),
            **{f"{p}_p50_ms": percentile([d["phases_ms"][p] for d in done], 50) for p in ("prefill_queue", "transfer")}}


def verdicts(points: list[dict]) -> list[dict]:
    """Per (link, output spread, rate, policy): which binding did best, by goodput, then TTFT p90 (a
    tie within 1% goodput goes to TTFT): where late binding beats early binding and where not."""
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault((p["link"], p["output_cv"], p["rate"], p["policy"]), []).append(p)
    out = []
    for (link, cv, rate, policy), rows in groups.items():
        best = max(rows, key=lambda r: (round(r["goodput"], 2), -r["ttft_p90_ms"]))
        out.append({"link": link, "output_cv": cv, "rate": rate, "policy": policy, "best": best["binding"],
                    **{r["binding"]: {"goodput": r["goodput"], "ttft_p90_ms": r["ttft_p90_ms"],
                                      "tpot_p90_ms": r["tpot_p90_ms"]} for r in rows}})
    return out


def print_costs(costs: Costs) -> None:
    print(f"calibrated on {costs.label} ({costs.mode}; {len(costs.prefill_workers)} prefill, "
          f"{len(costs.decode_workers)} decode workers; decode policy {costs.decode_policy}"
          f"{', late binding' if costs.late_binding else ''}; poll {costs.poll_s:g} s):")
    print(f"  prefill_compute = {costs.prefill_ms.a:.2f} ms + {costs.prefill_ms.b * 1e3:.3f} ms per 1k tokens; "
          f"transfer = {costs.transfer_ms.a:.2f} ms + {costs.transfer_ms.b:.2f} ms per MiB; "
          f"handoff_wait {costs.handoff_wait_ms:.2f} ms; {costs.kv_bytes_per_token / 1024:.2f} KiB of KV per token")
    for url, step in costs.step_ms.items():
        print(f"  decode {url}: step = {step.a:.2f} ms + {step.b:.3f} ms per sequence; second token "
              f"+{statistics.median(costs.second_token_ms[url]):.2f} ms (median) after the KV landed")
    print(f"  first token: +{statistics.median(costs.first_token_ms):.2f} ms (median) after the prompt was computed "
          "(from the prefill's answer)")


def main(args: argparse.Namespace) -> int:
    try:
        summary, rows = load_run(args.calibrate)
        costs = fit(summary, rows, args.point)
    except ValueError as exc:
        raise SystemExit(f"kvhandoff simulate: {exc}") from None
    defaults(args, costs)
    print_costs(costs)
    report = {"costs": costs.to_json(), "reproduction": reproduce(costs, rows, args.seed, args.layers)}
    print("\nthe calibration point replayed on its own fleet (medians, ms):")
    for name, r in report["reproduction"].items():
        print(f"  {name:<16} real {r['real_ms']:9.2f}  simulated {r['sim_ms']:9.2f}  "
              f"error {r['error'] * 100 if r['error'] is not None else 0:5.1f}%  "
              f"{'ok' if r['within'] else 'OFF (over 15% and 1 ms)'}")
    if args.router_costs:
        router = args.router_costs
        workers = args.prefill + args.decode
        report["routers"] = {"costs": router.__dict__, "max_rate": {r: router.max_rate(r, workers) for r in args.routers}}
        print(f"\nthe routers (measured at {router.measured_workers} workers: {router.decision_ms:.3f} ms of CPU a "
              f"request, {router.events_per_request:.1f} KV events a request at {router.us_per_event:.2f} us each, "
              f"{router.idle_ms_per_worker_s:.3f} ms per worker and second idle):")
        for r, rate in report["routers"]["max_rate"].items():
            print(f"  {r} router{'s' if r > 1 else ''} in front of {workers} workers: at most {rate:,.0f} requests/s "
                  "(one core each)")
    if args.rates:
        report["scaled"] = scaled(costs, args)
        print(f"\n{args.prefill}P/{args.decode}D, {args.requests} requests per point, seed {args.seed}:")
        print(f"{'link':>8} {'cv':>5} {'rate':>7} {'routers':>7} {'policy':<17} {'binding':<10} {'TTFT p50':>9} "
              f"{'p90':>8} {'p99':>8} {'TPOT p50':>9} {'p90':>7} {'p99':>7} {'goodput':>8} {'moved':>6}")
        for p in report["scaled"]:
            print(f"{p['link']:>8} {fmt_cv(p['output_cv']):>5} {p['rate']:>7g} {p['routers'] or '-':>7} "
                  f"{p['policy']:<17} {p['binding']:<10} "
                  f"{p['ttft_p50_ms']:9.1f} {p['ttft_p90_ms']:8.1f} {p['ttft_p99_ms']:8.1f} {p['tpot_p50_ms']:9.2f} "
                  f"{p['tpot_p90_ms']:7.2f} {p['tpot_p99_ms']:7.2f} {p['goodput']:8.0%} {p['moved']:>6}")
        if len(args.bindings) > 1:
            report["verdicts"] = verdicts(report["scaled"])
            print("\nthe best binding per point (goodput first, then TTFT p90):")
            for v in report["verdicts"]:
                print(f"{v['link']:>8} {fmt_cv(v['output_cv']):>5} {v['rate']:>7g} {v['policy']:<17} {v['best']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def defaults(args: argparse.Namespace, costs: Costs) -> None:
    """The comma-separated options as lists, the run's fleet and policy where none is given; a bad
    value ends with a message."""
    try:
        args.rates = [float(x) for x in args.rates.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"kvhandoff simulate: --rates must be numbers, not {args.rates!r}") from None
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()] or [costs.decode_policy]
    args.bindings = [x.strip() for x in args.bindings.split(",") if x.strip()] or [Fleet(costs, 1, 1).binding]
    args.links = [x.strip() for x in args.links.split(",") if x.strip()] or [FREE]
    bad_links = []
    for link in args.links:
        try:
            link == FREE or LinkSpec.parse(link)
        except ValueError as exc:
            bad_links.append(str(exc))
    if bad_links:
        raise SystemExit(f"kvhandoff simulate: {'; '.join(bad_links)}")
    try:
        args.output_cv = [None if x.strip() == "run" else float(x) for x in args.output_cv.split(",") if x.strip()] or [None]
    except ValueError:
        raise SystemExit(f"kvhandoff simulate: --output-cv takes numbers or 'run', not {args.output_cv!r}") from None
    args.transfer = args.transfer or ("layerwise" if costs.mode == "push-layerwise" else "whole")
    try:
        args.routers = [int(x) for x in args.routers.split(",") if x.strip()] or [1]
        args.router_costs = RouterCosts.from_bench(json.loads(args.router_costs.read_text())) \
            if args.router_costs else None
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise SystemExit(f"kvhandoff simulate: --routers/--router-costs: {exc}") from None
    args.prefill = args.prefill or len(costs.prefill_workers)
    args.decode = args.decode or len(costs.decode_workers)
    bad = ([f"policy {p!r}" for p in args.policies if p not in POLICIES]
           + [f"binding {b!r}" for b in args.bindings if b not in BINDINGS]
           + [f"rate {r:g}" for r in args.rates if r <= 0]
           + [f"{r} routers" for r in args.routers if r < 1]
           + [f"output cv {c:g}" for c in args.output_cv if c is not None and c < 0]
           + ([f"{args.prefill} prefill and {args.decode} decode workers"] if min(args.prefill, args.decode) < 1 else []))
    if bad:
        raise SystemExit(f"kvhandoff simulate: unknown or impossible {', '.join(bad)}; policies: "
                         f"{', '.join(POLICIES)}; bindings: {', '.join(BINDINGS)}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibrate", type=Path, required=True, metavar="DIR", help="a kvhandoff bench --out folder")
    p.add_argument("--point", default=None, help="the point to calibrate on (default: its first disaggregated one)")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (default: the run's)")
    p.add_argument("--decode", type=int, default=None, help="decode workers (default: the run's)")
    p.add_argument("--rates", default="", help="requests/s to simulate, comma-separated (none: only reproduce)")
    p.add_argument("--requests", type=int, default=1000, help="requests per simulated point (default: %(default)s)")
    p.add_argument("--policies", default="", help="decode policies, comma-separated (default: the run's)")
    p.add_argument("--bindings", default="", help="early (push), late (pull), late-bound (push with moves); "
                                                  "comma-separated (default: the run's)")
    p.add_argument("--poll-s", type=float, default=None, help="the router's poll interval (default: the run's)")
    p.add_argument("--links", default="", help="links between prefill and decode workers, comma-separated: free (the "
                                               "transfer as the run measured it) or a rate like 10gbit, 1gbit "
                                               "(default: free)")
    p.add_argument("--transfer", choices=("whole", "layerwise"), default=None,
                   help="behind a link, how push bindings send: all after the prompt, or each layer as computed "
                        "(default: the run's mode's)")
    p.add_argument("--layers", type=int, default=30, help="the model's layers, for layer-wise sending "
                                                          "(default: %(default)s, SmolLM2-135M's)")
    p.add_argument("--output-cv", default="run", help="output lengths: run (the run's) or coefficients of variation "
                                                      "of a lognormal with the run's mean, comma-separated, e.g. "
                                                      "0,1,2 (default: %(default)s)")
    p.add_argument("--router-costs", type=Path, default=None, metavar="FILE",
                   help="results.json of `python -m kvhandoff.bench.router --workers N`: model the routers' cost")
    p.add_argument("--routers", default="1", help="routers in front of the fleet, comma-separated (with --router-costs; "
                                                  "default: %(default)s)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE")
