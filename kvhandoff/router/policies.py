"""How the router ranks workers for a request (`--decode-policy`, `--prefill-policy`).

Every policy reads a snapshot: what each worker said at its last /health poll (every
--health-interval, 1 s by default, in the background) plus what this router itself sent it since.
None waits on the network while a request is routed. The pool (pool.py) always puts a worker that
failed this request, an unhealthy one and (for a conversation's next turn) one that is not the
holder of its history before the policy's order, and breaks ties in turn.

Decode:
- `round-robin`: in turn, whatever the load. The baseline the others are measured against.
- `fewest-in-flight` (default): this router's requests on the worker not finished yet, then the
  sequences it last reported. Knows nothing of how fast each worker is.
- `load`: the wait a new request should expect there: the worker's recent step time (`step_ms`,
  an average it reports) times the sequences it will step with (reported running, waiting and
  waiting-for-KV, plus what this router sent it since that report, plus this one). A worker that
  has not stepped yet is taken at the others' median step time. A slow or overloaded worker is
  avoided even when it holds as few requests as the others.
Prefill:
- `fewest-in-flight` (default), as above.
- `cache-aware`: the prefill worker whose prefix cache should hold the longest part of the prompt,
  weighed against its queue: cost = the prompt's tokens it would compute (those past the blocks it
  holds: the router's index of the workers' KV events, prefix.py) + the tokens it still has to
  prefill (what it reported, or the prompts this router has on it now if more). Nothing is asked on
  the request's path (a worker whose events are not fresh is asked: `/kv/prompt`); without any
  answer it falls back to fewest-in-flight.
  With `--bidirectional`, for a turn whose history a decode worker retains, the cost is in
  estimated milliseconds and each prefill worker of a shortlist (`reuse_shortlist`: those holding
  part of the prompt, and the two least queued others) has two ways (`reuse_estimate`): compute the
  prompt past what its own cache holds, or fetch the retained blocks it lacks (at least the reuse
  floor, 64 tokens) and compute the rest; both after its queue, at the rates it reports
  (`reuse_rates` in /health: its prefill cost fitted to what it measured, a fixed part, a part per
  token and a part growing with the context each token attends to; reverse-read bandwidth and
  fetch overhead). The cheapest worker and way win: its cache when that holds the history and it is idle,
  a fetch elsewhere when it is busy, recomputing when no fetch is worth it (`route_decision` in the
  handoff object; the prefill worker then decides for itself with exact figures: `reuse_decision`).
Late binding (`--late-binding`, push modes, any decode policy): the decode worker picked at arrival
is checked again at every poll while the prompt is still being computed; it has fallen behind when
the wait expected there (as `load` reckons it, this request among its sequences) is over
LATE_BINDING_MARGIN times (and more than one typical step above) the wait on the best other
healthy worker, and the request then moves there, once (native.py's rebind). Costs nothing per
poll but this arithmetic; a move costs one /kv/rebind round trip to the prefill worker and a second
decode leg.
Selective disaggregation (`--disagg-min-tokens N`, any policy): a prompt of which fewer than N
tokens are uncached on the best prefill worker goes to a decode worker as a plain request, which
computes it colocated: a short prompt does not pay for a handoff.
"""
from __future__ import annotations

import heapq
import statistics
import time
from typing import TYPE_CHECKING

from kvhandoff.wire.cost import CostModel, ReuseWay, common_prefix_blocks
from kvhandoff.wire.modes import DecodePolicy, PrefillPolicy

if TYPE_CHECKING:
    from kvhandoff.router.pool import Worker
    from kvhandoff.router.prefix import PrefixIndex, PromptFacts


def sequences(worker: Worker) -> int:
    """Sequences the worker will step with once this router's unreported requests land there."""
    h = worker.last_health
    reported = sum(int(h.get(k) or 0) for k in ("num_running", "num_waiting", "num_waiting_for_kv"))
    return reported + worker.routed_since_poll


def typical_step_ms(workers: list[Worker]) -> float:
    """What a worker that has not stepped yet is taken to step at: the others' median."""
    known = [w.last_health["step_ms"] for w in workers if w.last_health.get("step_ms")]
    return statistics.median(known) if known else 1.0


def expected_wait(worker: Worker, typical: float, joining: int = 1) -> float:
    """Its step time x the sequences it will step with, `joining` more of ours among them."""
    return (worker.last_health.get("step_ms") or typical) * (joining + sequences(worker))


# A move has to buy more than noise between equal workers: their step times wander by tens of percent.
LATE_BINDING_MARGIN = 1.5


def late_binding_target(current: Worker, workers: list[Worker],
                        excluded: set[str] = frozenset()) -> tuple[Worker, float, float] | None:
    """Late binding: (the decode worker to move a request to, the wait expected on the current one,
    the wait expected there), or None while the current one has not fallen behind. The current
    worker's reported sequences already count the request (it waits there for its K/V)."""
    typical = typical_step_ms(workers)
    others = [w for w in workers if w is not current and w.healthy and w.url not in excluded]
    if not others:
        return None
    best = min(others, key=lambda w: expected_wait(w, typical))
    here, there = expected_wait(current, typical, joining=0), expected_wait(best, typical)
    # ... and by more than a step: between idle workers whose steps take a few ms, a ratio alone is noise.
    return (best, here, there) if here > LATE_BINDING_MARGIN * there and here - there > typical else None


def uncached_tokens(worker: Worker, facts: PromptFacts, index: PrefixIndex) -> int:
    return max(0, facts.num_tokens - facts.cached_blocks(worker.url, index) * facts.block_size)


def queued_prefill_tokens(worker: Worker) -> int:
    """What it reported at its last poll less the share its own rates say it has computed since, or what
    this router has on it now if that is more (sent since). Another router's prompts end unseen here: a
    report taken while one was computed would otherwise keep an idle worker looking busy for up to a poll
    interval, and send every prompt that it caches elsewhere (as CI's two-router test once saw)."""
    reported = int(worker.last_health.get("num_tokens_to_prefill") or 0)
    if reported > 0:
        elapsed_ms = (time.monotonic() - worker.polled_at) * 1e3
        reported = int(reported * max(0.0, 1.0 - elapsed_ms / max(cost_model(worker).prefill.ms(reported), 1e-3)))
    return max(reported, worker.tokens_in_flight)


def cost_model(worker: Worker) -> CostModel:
    """The cost model the worker's last /health reported (`reuse_rates`), read once per poll."""
    seen = worker.rates_seen
    if seen is None or seen[0] is not worker.last_health:
        seen = worker.rates_seen = (worker.last_health, CostModel.from_rates(worker.last_health.get("reuse_rates") or {}))
    return seen[1]


def reuse_estimate(worker: Worker, facts: PromptFacts, index: PrefixIndex, history: list[str] | int, floor: int) -> dict:
    """One prefill worker's way to a prompt whose history (`history`, block hashes) a decode worker
    retains: compute past its own cached prefix, or fetch what it lacks of the history and compute the
    rest, whichever it should finish first (ms, its queue included). At least one prompt token is
    always computed (it yields the first output token). Costs at the rates it reports (`reuse_rates`
    in /health: wire.cost.CostModel's prefill cost, reverse-read bandwidth and fixed cost; its
    defaults before the worker has measured any)."""
    bs, limit = facts.block_size, (facts.num_tokens - 1) // facts.block_size
    cached = min(facts.cached_blocks(worker.url, index), limit)
    # (`history`: its hashes, or how many leading blocks it shares with the prompt, counted once per turn)
    shared = history if isinstance(history, int) else common_prefix_blocks(facts.block_hashes, history)
    fetchable = min(shared, limit)
    model = cost_model(worker)
    prefill = model.prefill
    # The queue's prompts are of unknown context: each taken at the cost of tokens from an empty cache.
    queued = queued_prefill_tokens(worker)
    queue_ms = prefill.ms(queued)
    compute_ms = queue_ms + prefill.ms(facts.num_tokens - cached * bs, cached * bs)
    row = {"url": worker.url, "cached_tokens": cached * bs, "fetchable_tokens": fetchable * bs,
           "queued_tokens": queued, "est_compute_ms": round(compute_ms, 3),
           "option": ReuseWay.CACHE if cached * bs >= floor else ReuseWay.RECOMPUTE, "est_ms": compute_ms}
    if (fetchable - cached) * bs >= floor:
        fetch_ms = model.fetch_s((fetchable - cached) * int(worker.last_health.get("block_bytes") or 0)) * 1e3
        with_fetch_ms = queue_ms + fetch_ms + prefill.ms(facts.num_tokens - fetchable * bs, fetchable * bs)
        row["est_fetch_ms"] = round(fetch_ms, 3)
        if with_fetch_ms < compute_ms:
            row.update(option=ReuseWay.FETCH, est_ms=with_fetch_ms)
    row["est_ms"] = round(row["est_ms"], 3)
    return row


# The least-queued prefill workers holding none of the prompt that a three-way choice weighs beside
# those holding some: the others can only do worse (same cost model, longer queue) unless their
# reported rates differ, and weighing every worker of a large fleet would cost each turn O(workers).
SHORTLIST_OTHERS = 2
SHORTLIST_HOLDERS = 4           # ... beside the workers holding the longest part of the prompt


def reuse_shortlist(workers: list[Worker], facts: PromptFacts, index: PrefixIndex,
                    excluded: set[str] = frozenset()) -> list[Worker]:
    """The prefill workers a conversation's next turn weighs (reuse_estimate): the SHORTLIST_HOLDERS
    that hold the longest part of the prompt (a shared system prompt can be on every worker), and the
    SHORTLIST_OTHERS least queued (healthy, not excluded, first) of the rest."""
    depth = {w.url: facts.cached_blocks(w.url, index) for w in workers}
    holding = heapq.nlargest(SHORTLIST_HOLDERS, (w for w in workers if depth[w.url]), key=lambda w: depth[w.url])
    held = {w.url for w in holding}
    rest = [w for w in workers if w.url not in held]
    others = heapq.nsmallest(SHORTLIST_OTHERS, rest, key=lambda w: (w.url in excluded, not w.healthy,
                                                                     queued_prefill_tokens(w)))
    return holding + others


def ranking(policy: DecodePolicy | PrefillPolicy, workers: list[Worker], facts: PromptFacts | None = None,
            index: PrefixIndex | None = None):
    """key(worker) -> a sortable cost, lowest first, for one pick among `workers`."""
    if policy is DecodePolicy.ROUND_ROBIN:
        return lambda w: 0
    if policy is DecodePolicy.LOAD:
        typical = typical_step_ms(workers)
        return lambda w: expected_wait(w, typical)
    if policy is PrefillPolicy.CACHE and facts is not None and index is not None:
        return lambda w: uncached_tokens(w, facts, index) + queued_prefill_tokens(w)
    return lambda w: (w.in_flight, w.load)
