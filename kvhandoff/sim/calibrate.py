"""What each phase costs, fitted from a real `kvhandoff bench` run (its results.jsonl and summary.json),
never from the engine: the simulator reads bench results only.

From one measured point of a disaggregated stack:
- prefill: `prefill_compute` ms as a linear function of the tokens the prefill worker computed during
  the prompt's window (its own, prompt tokens less the reused ones, and those of the prompts computed
  beside it, pro rata): the cost of an engine step's tokens;
- transfer: the `transfer` phase as a linear function of the bytes moved;
- decode: per decode worker, ms per step as a linear function of the sequences it stepped with. A
  request's step time is the mean gap between its tokens after the second; the sequences beside it
  are counted from the other requests' decode windows on the same worker (the client-side
  timestamps), averaged over its own window;
- fixed costs: the median `prefill_queue` of requests that found their prefill worker idle (HTTP and
  admission: what a request waits even with nobody ahead of it), the median of `handoff_wait`;
- the two first tokens (protocol 5, issue 24): the first reaches the client from the prefill's
  answer, so what it takes beyond the prompt's computation (the hops and the relay; more when its
  text was held back for the decode worker's) is measured per request; the second comes from the
  decode worker's first step once the KV has landed (`decode_queue` + `first_step`), per decode
  worker (a slow worker steps later);
- the workload's shape: prompt and output lengths as sampled, bytes of KV per prompt token;
- the spread around those lines, as measured: per request, its prefill time and its transfer less the
  fitted ones (a busy core adds milliseconds, not percent), each kept with its size (`Spread`: the
  simulator draws a residual among the requests nearest in size, since a loaded machine spreads a
  long prompt's time by more than a short one's, and a short prompt given a long one's residual
  would be clamped at zero and shift the median), its TPOT over the fitted one (a ratio: it scales
  every step), and the delays of its first two tokens; the simulator draws from these, seeded, so
  that it reproduces percentiles and medians of mixtures, not just the lines;
- the fleet: its prefill and decode workers, decode policy, late binding and poll interval, as the
  router's /health reported them when the point started, and the emulated link its launch spec
  named (`+link=RATE`): a replay of such a run sends the KV through a link of that rate.
"""
from __future__ import annotations

import bisect
import json
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvhandoff.launch.netlink import LinkSpec


@dataclass
class Linear:
    """y = a + b x, both at least 0 (a cost that falls with size is noise, not a cost)."""
    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a + self.b * x

    @classmethod
    def fit(cls, xs: list[float], ys: list[float]) -> "Linear":
        """Theil-Sen: the median of the pairwise slopes, then the median intercept. A few slow
        requests (a warm-up, a busy moment) would drag a least-squares line off the typical one,
        and the simulator has to reproduce medians."""
        if not ys:
            return cls(0.0, 0.0)
        pairs = sorted(zip(xs, ys))[:: max(1, len(xs) // 300)]      # (O(n^2) pairs: at most ~45k)
        slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pairs) for x2, y2 in pairs[i + 1:] if x2 != x1]
        b = max(0.0, statistics.median(slopes)) if slopes else 0.0
        a = statistics.median(y - b * x for x, y in zip(xs, ys))
        if a < 0:                               # through the origin instead
            a, b = 0.0, statistics.median(y / x for x, y in zip(xs, ys) if x > 0)
        return cls(a, b)


@dataclass
class Spread:
    """Residuals around a fitted line, each at the size it was measured at (sorted by size)."""
    points: list[tuple[float, float]] = field(default_factory=list)      # (size, measured - fitted)

    @classmethod
    def of(cls, sizes: list[float], residuals: list[float]) -> "Spread":
        return cls(sorted(zip(sizes, residuals)))

    def draw(self, rng, size: float) -> float:
        """One of the residuals measured nearest this size: among the closest fifth (at least 4)."""
        if not self.points:
            return 0.0
        k = min(len(self.points), max(4, len(self.points) // 5))
        at = bisect.bisect_left(self.points, (size,))
        start = max(0, min(at - k // 2, len(self.points) - k))
        return rng.choice(self.points[start:start + k])[1]


@dataclass
class Costs:
    label: str                               # the bench point it was fitted on
    mode: str                                # pull, pull-reader, push, push-layerwise
    prefill_ms: Linear                       # per prompt tokens computed in a step (or a window of steps)
    transfer_ms: Linear                      # per MiB moved
    step_ms: dict[str, Linear]               # decode worker URL -> ms per step, per sequence in its batch
    handoff_wait_ms: float
    admission_ms: float                      # prefill_queue with nobody ahead
    first_token_ms: list[float]              # the prompt computed -> the client's first token, as measured
    second_token_ms: dict[str, list[float]]  # decode worker URL -> the KV landed -> its first step done
    kv_bytes_per_token: float
    prefill_workers: list[str]
    decode_workers: list[str]
    decode_policy: str = "fewest-in-flight"
    late_binding: bool = False
    poll_s: float = 1.0
    link_bits_per_s: float | None = None     # the run's emulated link (its launch spec's +link=RATE), if any
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    computed_tokens: list[int] = field(default_factory=list)            # of each prompt, what its prefill computed
    prefill_spread: Spread = field(default_factory=Spread)              # by tokens computed: measured - fitted ms
    transfer_spread: Spread = field(default_factory=Spread)             # by MiB moved: measured - fitted ms
    step_spread: dict[str, list[float]] = field(default_factory=dict)    # decode worker URL -> TPOT / fitted
    # arrival at the router -> the prefill worker's engine has the request (the router's dispatch, the
    # way there, parsing and tokenizing), as measured; the first token's delay is counted after it.
    # Empty, or one per first_token_ms entry, the same request's (they are drawn as a pair).
    ingress_ms: list[float] = field(default_factory=list)

    def __post_init__(self):
        assert self.first_token_ms and (not self.ingress_ms or len(self.ingress_ms) == len(self.first_token_ms))

    def to_json(self) -> dict:
        return asdict(self)


def load_run(run: Path) -> tuple[dict, list[dict]]:
    """(summary.json, results.jsonl rows) of a bench run's --out folder; ValueError saying what is missing."""
    try:
        summary = json.loads((run / "summary.json").read_text())
        rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise ValueError(f"{run} is not a kvhandoff bench output folder (summary.json, results.jsonl): {exc}") from None
    return summary, rows


def phase(row: dict, name: str) -> float | None:
    return ((row.get("handoff") or {}).get("phases_ms") or {}).get(name)


def computed_tokens(row: dict) -> int:
    """The prompt tokens its prefill worker computed: not those its own prefix cache served
    (prefill_cached_tokens) nor those fetched from a decode worker (reused_tokens). At least one
    is always computed (it yields the first token)."""
    h = row.get("handoff") or {}
    return max(1, row["prompt_tokens"] - (h.get("reused_tokens") or 0) - (h.get("prefill_cached_tokens") or 0))


def usable(row: dict) -> bool:
    """A successful request with a remote handoff, every phase and the client's timestamps."""
    h = row.get("handoff") or {}
    return (row["ok"] and row.get("sent_s") is not None and row.get("tpot_ms") is not None
            and h.get("kv_source") == "remote"
            and all(phase(row, p) is not None for p in ("prefill_queue", "prefill_compute", "transfer")))


def ingress_ms(row: dict) -> float:
    """The part of the first token's way before the prefill's engine has it (TTFT phases, issue 24):
    the router's dispatch, half the hops, and the prefill worker's own time outside its queue and
    compute (mostly parsing and tokenizing). 0 for a run whose handoff objects lack them."""
    return ((phase(row, "router_dispatch") or 0) + (phase(row, "prefill_hops") or 0) / 2
            + (phase(row, "prefill_request") or 0))


def step_time(row: dict) -> float:
    """Its decode worker's time per step while it was in the batch: the mean gap between its tokens
    after the second (the gap to the second is the transfer's and the first step's, drawn apart);
    its TPOT where the client saw too few tokens to tell."""
    gaps = (row.get("itl_ms") or [])[1:]
    return statistics.fmean(gaps) if gaps else row["tpot_ms"]


def batch_sizes(rows: list[dict]) -> list[float]:
    """Per row: the sequences its decode worker stepped with on average during its decode window."""
    windows = [(r["handoff"]["decode_worker"], r["sent_s"] + r["ttft_ms"] / 1e3, r["sent_s"] + r["e2e_ms"] / 1e3)
               for r in rows]
    sizes = []
    for worker, start, end in windows:
        span = max(end - start, 1e-9)
        beside = sum(max(0.0, min(end, e) - max(start, s)) for w, s, e in windows if w == worker) / span
        sizes.append(beside)                 # (its own window counts once: itself)
    return sizes


def prefill_work(rows: list[dict], computed: list[int]) -> list[float]:
    """Per row: the prompt tokens its prefill worker computed during its prefill window (its own and,
    pro rata, those of every prompt whose window overlapped it on that worker). The engine computes
    the prompts it holds together, a step at a time, so a prompt's time is the cost of everything
    computed beside it: fitted against this, the line is the cost of a step's tokens."""
    windows = [(r["handoff"].get("prefill_worker"), r["sent_s"] + phase(r, "prefill_queue") / 1e3,
                r["sent_s"] + (phase(r, "prefill_queue") + phase(r, "prefill_compute")) / 1e3, n)
               for r, n in zip(rows, computed)]
    work = []
    for i, (worker, start, end, tokens) in enumerate(windows):
        beside = sum(n * max(0.0, min(end, e) - max(start, s)) / max(e - s, 1e-9)
                     for j, (w, s, e, n) in enumerate(windows) if j != i and w == worker)
        work.append(tokens + beside)
    return work


def admission(rows: list[dict]) -> float:
    """The median prefill_queue of the requests that arrived while no other was being prefilled (all of
    them if none did): the queue phase's fixed part."""
    spans = [(r["sent_s"] + phase(r, "prefill_queue") / 1e3,
              r["sent_s"] + (phase(r, "prefill_queue") + phase(r, "prefill_compute")) / 1e3) for r in rows]
    idle = [phase(r, "prefill_queue") for i, r in enumerate(rows)
            if not any(s <= r["sent_s"] < e for j, (s, e) in enumerate(spans) if j != i)]
    return statistics.median(idle or [phase(r, "prefill_queue") for r in rows])


def link_of(spec: str) -> float | None:
    """The emulated link's rate in a `kvhandoff bench --launch` spec (push+link=1gbit), if it names one."""
    m = re.search(r"\+link=([^+@,]+)", spec)
    return LinkSpec(m[1]).bits_per_s if m else None


def fit(summary: dict, rows: list[dict], label: str | None = None) -> Costs:
    """Costs from one point of the run (`label`; default: the first disaggregated one)."""
    points = {p["label"]: p for p in summary["points"]}
    if label is None:
        label = next((p["label"] for p in summary["points"] if p.get("phases_ms", {}).get("transfer")), None)
        if label is None:
            raise ValueError("no point of this run has handoff phases: calibrate on a disaggregated stack")
    if label not in points:
        raise ValueError(f"no point {label!r} in this run; points: {', '.join(points)}")
    mine = [r for r in rows if r["point"] == label and usable(r)]
    if len(mine) < 8:
        raise ValueError(f"point {label!r} has {len(mine)} usable requests; at least 8 are needed to fit costs")
    server = points[label].get("server") or {}
    workers = server.get("workers") or []
    prefill = [w["url"] for w in workers if w.get("role") == "prefill"] or \
        sorted({r["handoff"]["prefill_worker"] for r in mine})
    decode = [w["url"] for w in workers if w.get("role") == "decode"] or \
        sorted({r["handoff"]["decode_worker"] for r in mine})
    computed = [computed_tokens(r) for r in mine]
    mib = [(r["handoff"].get("bytes_transferred") or 0) / 2**20 for r in mine]
    sizes = batch_sizes(mine)
    steps = {}
    for url in decode:
        on = [(b, step_time(r)) for b, r in zip(sizes, mine) if r["handoff"]["decode_worker"] == url]
        if on:
            steps[url] = Linear.fit([b for b, _ in on], [t for _, t in on])
    for url in decode:              # a worker that served none of these: taken as the typical one
        steps.setdefault(url, Linear(statistics.median(f.a for f in steps.values()),
                                     statistics.median(f.b for f in steps.values())))
    ingress = [ingress_ms(r) for r in mine]
    first = [max(0.0, r["ttft_ms"] - before - sum(phase(r, p) or 0 for p in ("prefill_queue", "prefill_compute")))
             for r, before in zip(mine, ingress)]
    second = {url: [max(0.0, sum(phase(r, p) or 0 for p in ("decode_queue", "first_step")))
                    for r in mine if r["handoff"]["decode_worker"] == url] for url in decode}
    typical = [statistics.median(v for values in second.values() for v in values)]
    work = prefill_work(mine, computed)
    prefill_ms = Linear.fit(work, [phase(r, "prefill_compute") for r in mine])
    transfer_ms = Linear.fit(mib, [phase(r, "transfer") for r in mine])
    spread = {url: [step_time(r) / steps[url](b) for b, r in zip(sizes, mine)
                    if r["handoff"]["decode_worker"] == url and steps[url](b) > 0] or [1.0] for url in decode}
    return Costs(
        label=label, mode=mine[0]["handoff"]["mode"],
        prefill_ms=prefill_ms,
        transfer_ms=transfer_ms, step_ms=steps,
        handoff_wait_ms=statistics.median(phase(r, "handoff_wait") or 0 for r in mine), admission_ms=admission(mine),
        first_token_ms=first, second_token_ms={url: v or typical for url, v in second.items()}, ingress_ms=ingress,
        prefill_spread=Spread.of(work, [phase(r, "prefill_compute") - prefill_ms(w) for r, w in zip(mine, work)]),
        transfer_spread=Spread.of(mib, [phase(r, "transfer") - transfer_ms(m) for r, m in zip(mine, mib)]),
        step_spread=spread,
        # per prompt token, as the replay charges it (a decode worker's own prefix cache may have spared some)
        kv_bytes_per_token=statistics.median((r["handoff"].get("bytes_transferred") or 0) / max(1, r["prompt_tokens"])
                                             for r in mine),
        prefill_workers=prefill, decode_workers=decode,
        decode_policy=server.get("decode_policy", "fewest-in-flight"), late_binding=bool(server.get("late_binding")),
        poll_s=float(server.get("health_interval") or 1.0), link_bits_per_s=link_of(points[label].get("mode") or ""),
        prompt_tokens=[r["prompt_tokens"] for r in mine], output_tokens=[r["output_tokens"] for r in mine],
        computed_tokens=computed)
