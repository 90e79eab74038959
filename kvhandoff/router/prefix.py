"""What the router knows of each prefill worker's prefix cache, for `--prefill-policy cache-aware` and
`--disagg-min-tokens` (policies.py).

The router never sees KV. It tokenizes the prompt itself (prompts.py) and looks its block chain up in
its index of the workers' KV events (kv_index.py): what each worker holds now, whichever router sent
the prompts that filled it, with no call on the request's path. A worker whose events are not fresh
(kv_feed.py: stopped, or a worker that does not publish) is asked instead (`/kv/prompt`: how many
tokens, the chain hashes of its full blocks, and how many of those its cache holds right now), as is
one of them when the router has no tokenizer yet.

For a worker that did not answer, the router falls back on its own record: per prefill worker, the
hashes of the prompts it sent there, most recent last, at most as many as that worker has blocks.
Either way an estimate: a block may be evicted a moment later; the worker then computes it, and the
output is the same. (A prompt still being computed counts for nothing yet, so two requests with one
new prefix that arrive together may go to different workers.)
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvhandoff.router.answer import UpstreamError
from kvhandoff.wire import messages as M
from kvhandoff.wire.modes import Role

log = logging.getLogger("kvhandoff.router")
DEFAULT_CAPACITY = 4096            # blocks remembered per worker until its /health says how many it has


@dataclass
class PromptFacts:
    num_tokens: int
    block_hashes: list[str]
    block_size: int
    cached: dict[str, int] = field(default_factory=dict)     # worker URL -> leading blocks it holds (index, or its answer)
    keys: list[bytes] = field(default_factory=list)          # block_hashes as bytes (the index's keys), when made here
    indexed: frozenset[str] = frozenset()                    # workers the index answered for (absent from cached: 0)

    def cached_blocks(self, url: str, index: PrefixIndex) -> int:
        """Leading blocks of the prompt the worker at `url` holds: the index's or its answer, else this
        router's record."""
        reported = self.cached.get(url)
        if reported is not None:
            return reported
        return 0 if url in self.indexed else index.cached_blocks(url, self.block_hashes)


class PrefixIndex:
    def __init__(self):
        self.by_worker: dict[str, OrderedDict[str, None]] = {}

    def cached_blocks(self, url: str, hashes: list[str]) -> int:
        """Leading blocks of the prompt the worker at `url` should still hold."""
        known = self.by_worker.get(url)
        if not known:
            return 0
        n = 0
        while n < len(hashes) and hashes[n] in known:
            n += 1
        return n

    def record(self, url: str, hashes: list[str], capacity: int | None) -> None:
        known = self.by_worker.setdefault(url, OrderedDict())
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > (capacity or DEFAULT_CAPACITY):
            known.popitem(last=False)

    def forget(self, url: str) -> None:
        """The worker restarted or left: its cache is gone."""
        self.by_worker.pop(url, None)


async def prompt_facts(router, attempt, every_worker: bool = False) -> PromptFacts | None:
    """The request's token count and block hashes, with what every serving prefill worker caches of it
    (`every_worker`). From the router's own tokenizer and index where it can; else from the least-loaded
    prefill worker (or every one whose events are not fresh). None if none can say: the request then
    goes by the other signals, and a bad request fails at the worker."""
    serving = router.pool.serving(Role.PREFILL)
    facts = router.local_facts(attempt)
    if facts is None:
        return await ask(router, attempt, serving if every_worker else [router.pool.least_loaded(Role.PREFILL)])
    if every_worker:
        fresh = router.feeds.fresh_urls()
        started = time.perf_counter_ns()
        facts.cached = router.index.cached_blocks(facts.keys, fresh)
        router.index.lookup_ns.append(time.perf_counter_ns() - started)
        facts.indexed = fresh
        stale = [w for w in serving if w.url not in fresh]
        if stale:
            asked = await ask(router, attempt, stale)
            if asked is not None and (asked.num_tokens, asked.block_hashes) == (facts.num_tokens, facts.block_hashes):
                facts.cached.update(asked.cached)
    return facts


async def ask(router, attempt, workers: list) -> PromptFacts | None:
    """Each of `workers` at once: the prompt's facts, and how many of its blocks each caches."""
    query = M.PromptQuery(endpoint=attempt.endpoint, request=attempt.body)
    router.metrics.asked.labels("/kv/prompt").inc(len(workers))

    async def one(worker) -> PromptFacts | None:
        try:
            status, data = await router.upstream.call("POST", worker.url + "/kv/prompt", query, timeout=10.0)
            data = data if status == 200 and isinstance(data, dict) else {}
            return PromptFacts(int(data["num_tokens"]), [str(h) for h in data["block_hashes"]], int(data["block_size"]),
                               {worker.url: int(data.get("cached_blocks") or 0)})
        except (UpstreamError, ValueError, KeyError, TypeError) as e:
            log.debug("handoff %s: no prompt facts from %s (%s)", attempt.handoff_id, worker.url, e)
            return None
    answers = [a for a in await asyncio.gather(*(one(w) for w in workers)) if a is not None]
    if not answers:
        return None
    facts = answers[0]
    for other in answers[1:]:
        if (other.num_tokens, other.block_hashes) == (facts.num_tokens, facts.block_hashes):
            facts.cached.update(other.cached)     # (a worker on another model or block size: not comparable)
    return facts
