"""What the router knows of each prefill worker's prefix cache, for `--prefill-policy cache-aware` and
`--disagg-min-tokens` (policies.py).

The router never sees KV. It asks one prefill worker for a request's prompt facts (`/kv/prompt`:
how many tokens, and the chain hashes of its full blocks: the worker tokenizes) and keeps, per
prefill worker, the hashes of the prompts it sent there, most recent last, at most as many as that
worker has blocks. A prompt's blocks that a worker computed stay in its prefix cache until evicted,
so the longest run of leading hashes on record is the router's estimate of what the worker would
not have to compute. An estimate only: a worker may have evicted them (or restarted); it then
computes them, and the output is the same.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from kvhandoff.router.upstream import UpstreamError

log = logging.getLogger("kvhandoff.router")
DEFAULT_CAPACITY = 4096            # blocks remembered per worker until its /health says how many it has


@dataclass
class PromptFacts:
    num_tokens: int
    block_hashes: list[str]
    block_size: int


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


async def prompt_facts(router, attempt) -> PromptFacts | None:
    """The request's token count and block hashes, from the least-loaded prefill worker (None if it
    cannot say: the request then goes by the other signals, and a bad request fails at the worker)."""
    worker = router.pool.least_loaded("prefill")
    try:
        status, data = await router.upstream.call("POST", worker.url + "/kv/prompt",
                                                  {"endpoint": attempt.endpoint, "request": attempt.body}, timeout=10.0)
        data = data if status == 200 and isinstance(data, dict) else {}
        return PromptFacts(int(data["num_tokens"]), [str(h) for h in data["block_hashes"]], int(data["block_size"]))
    except (UpstreamError, ValueError, KeyError, TypeError) as e:
        log.debug("handoff %s: no prompt facts from %s (%s)", attempt.handoff_id, worker.url, e)
        return None
