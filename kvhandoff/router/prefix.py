"""What the router knows of each prefill worker's prefix cache, for `--prefill-policy cache-aware` and
`--disagg-min-tokens` (policies.py).

The router never sees KV. It asks the prefill workers for a request's prompt facts (`/kv/prompt`:
how many tokens, the chain hashes of its full blocks, and how many of those the worker's prefix
cache holds right now: the worker tokenizes and looks). Cache-aware routing asks every serving
prefill worker at once (one round trip), so what it weighs is what each worker holds, whichever
router sent the prompts that filled it; a lookup that needs only the hashes asks one worker.

For a worker that did not answer, the router falls back on its own record: per prefill worker, the
hashes of the prompts it sent there, most recent last, at most as many as that worker has blocks.
Either way an estimate: a block may be evicted a moment later; the worker then computes it, and the
output is the same. (A prompt still being computed counts for nothing in a worker's answer, so two
requests with one new prefix that arrive together may go to different workers.)
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from kvhandoff.router.upstream import UpstreamError

log = logging.getLogger("kvhandoff.router")
DEFAULT_CAPACITY = 4096            # blocks remembered per worker until its /health says how many it has


@dataclass
class PromptFacts:
    num_tokens: int
    block_hashes: list[str]
    block_size: int
    cached: dict[str, int] = field(default_factory=dict)     # worker URL -> leading blocks it holds, as it said

    def cached_blocks(self, url: str, index: PrefixIndex) -> int:
        """Leading blocks of the prompt the worker at `url` holds: its answer, else this router's record."""
        reported = self.cached.get(url)
        return reported if reported is not None else index.cached_blocks(url, self.block_hashes)


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
    """The request's token count and block hashes, from the least-loaded prefill worker, or from every
    serving one with what each caches (`every_worker`). None if none can say: the request then goes
    by the other signals, and a bad request fails at the worker."""
    workers = router.pool.serving("prefill") if every_worker else [router.pool.least_loaded("prefill")]
    query = {"endpoint": attempt.endpoint, "request": attempt.body}

    async def ask(worker) -> PromptFacts | None:
        try:
            status, data = await router.upstream.call("POST", worker.url + "/kv/prompt", query, timeout=10.0)
            data = data if status == 200 and isinstance(data, dict) else {}
            return PromptFacts(int(data["num_tokens"]), [str(h) for h in data["block_hashes"]], int(data["block_size"]),
                               {worker.url: int(data.get("cached_blocks") or 0)})
        except (UpstreamError, ValueError, KeyError, TypeError) as e:
            log.debug("handoff %s: no prompt facts from %s (%s)", attempt.handoff_id, worker.url, e)
            return None
    answers = [a for a in await asyncio.gather(*(ask(w) for w in workers)) if a is not None]
    if not answers:
        return None
    facts = answers[0]
    for other in answers[1:]:
        if (other.num_tokens, other.block_hashes) == (facts.num_tokens, facts.block_hashes):
            facts.cached.update(other.cached)     # (a worker on another model or block size: not comparable)
    return facts
