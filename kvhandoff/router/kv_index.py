"""What every worker holds, as this router has read it from their KV events (wire/kv_events.py): the
index a routing decision reads instead of asking the workers on the request's path.

Blocks are indexed by key: the chain hash of their token ids (engine/block_pool.block_hash). Our
workers publish exactly those hashes (`hash_scheme` in their /health), which are taken as they come;
for a worker with another scheme or a seed, such as vLLM's, the key is made from the event's tokens,
and `keys` maps its hashes to ours for its removals and children. `holders` maps a key to the workers that hold it, so a
prompt's lookup walks its blocks once, keeping the workers still matching (Dynamo's radix-tree idea,
flattened: a chain hash names its whole prefix), whatever the fleet's size.

Retained conversations (medium RETAINED) go to the session map (sessions.py). An index that is stale
never gives a wrong answer: the worker checks what it is asked for, and what it lacks it computes.
"""
from __future__ import annotations

import statistics
import sys
from collections import deque
from typing import TYPE_CHECKING

from kvhandoff.engine.block_pool import block_hash
from kvhandoff.wire import kv_events as E

if TYPE_CHECKING:
    from kvhandoff.router.sessions import Sessions

EMPTY: frozenset = frozenset()


class KVIndex:
    def __init__(self, sessions: Sessions | None = None):
        self.holders: dict[bytes, set[str]] = {}
        self.keys: dict[str, dict[bytes | int, bytes]] = {}     # worker URL -> its block hash -> our key
        self.sessions = sessions                                # where retained conversations go
        self.lookup_ns: deque[int] = deque(maxlen=10_000)       # the last lookups' durations (admin stats)
        self.apply_ns = 0                                       # live batches: decoding and applying them (kv_feed.py)
        self.counters = {"events": 0, "stored": 0, "removed": 0, "cleared": 0}     # events; blocks stored, removed

    def apply(self, url: str, batch: E.KVEventBatch, retention_ttl_s: float | None, ours: bool = False) -> None:
        """`ours`: the worker hashes blocks as engine/block_pool does, so its hashes are our keys."""
        self.counters["events"] += len(batch.events)
        for event in batch.events:
            if isinstance(event, E.BlockStored):
                if event.medium == E.MEDIUM_RETAINED:
                    if self.sessions is not None:
                        self.sessions.event_retained(url, event, retention_ttl_s, batch.ts)
                else:
                    self.stored(url, event, ours)
            elif isinstance(event, E.BlockRemoved):
                if event.medium == E.MEDIUM_RETAINED:
                    if self.sessions is not None:
                        self.sessions.event_unretained(url, event)
                else:
                    self.removed(url, event.block_hashes)
            else:
                self.forget(url)

    def stored(self, url: str, event: E.BlockStored, ours: bool = False) -> None:
        mine = self.keys.setdefault(url, {})
        if ours:            # (the same keys the tokens would give: engine/block_pool.block_hash)
            for key in event.block_hashes:
                if key not in mine:
                    mine[key] = key
                    self.holders.setdefault(key, set()).add(url)
                    self.counters["stored"] += 1
            return
        bs = event.block_size
        parent = event.parent_block_hash
        # A parent it no longer holds (evicted before its child): keyed by its own hash, which for our
        # scheme is the key (the child is unreachable for a prefix match until the parent is back).
        parent_key = None if parent is None else mine.get(parent, parent if isinstance(parent, bytes) else None)
        if parent is not None and parent_key is None:
            return
        for i, worker_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * bs:(i + 1) * bs]
            if len(tokens) < bs:
                break
            key = block_hash(parent_key, tokens)
            if worker_hash not in mine:
                mine[worker_hash] = key
                self.holders.setdefault(key, set()).add(url)
                self.counters["stored"] += 1
            parent_key = key

    def removed(self, url: str, hashes: list) -> None:
        mine = self.keys.get(url)
        if not mine:
            return
        for worker_hash in hashes:
            key = mine.pop(worker_hash, None)
            if key is None:
                continue
            holders = self.holders.get(key)
            if holders is not None:
                holders.discard(url)
                if not holders:
                    del self.holders[key]
            self.counters["removed"] += 1

    def forget(self, url: str) -> None:
        """The worker restarted, left, or sends a snapshot: nothing it held is known any more."""
        self.removed(url, list(self.keys.get(url, ())))
        self.keys.pop(url, None)
        self.counters["cleared"] += 1
        if self.sessions is not None:
            self.sessions.worker_cleared(url)

    def cached_blocks(self, keys: list[bytes], urls: set[str] | None = None) -> dict[str, int]:
        """How many leading blocks of a prompt (its chain `keys`) each worker holds, for every worker that
        holds its first block (among `urls`, if given); others hold none."""
        if not keys:
            return {}
        active = set(self.holders.get(keys[0], EMPTY))
        if urls is not None:
            active &= urls
        depth: dict[str, int] = {}
        for n, key in enumerate(keys[1:], start=1):
            if not active:
                break
            here = self.holders.get(key, EMPTY)
            if not active <= here:
                for url in active - here:
                    depth[url] = n
                active &= here
        for url in active:
            depth[url] = len(keys)
        return depth

    def held(self, url: str) -> list[bytes]:
        """The keys of every block the worker holds, as far as this index knows."""
        return list(self.keys.get(url, {}).values())

    def nbytes(self) -> int:
        """What the index takes in memory (its dicts, sets and keys; an estimate to within a few %)."""
        size = sys.getsizeof(self.holders) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in self.holders.items())
        for mine in self.keys.values():
            size += sys.getsizeof(mine) + sum(sys.getsizeof(h) for h in mine)
        return size

    def stats(self) -> dict:
        """For /admin/kv-index: its size, what it absorbed, how long its lookups take (us)."""
        lookups = sorted(self.lookup_ns)
        pct = (lambda q: round(lookups[min(len(lookups) - 1, int(q * len(lookups)))] / 1e3, 2)) if lookups else None
        return {"blocks": len(self.holders), "workers": len(self.keys), "nbytes": self.nbytes(), **self.counters,
                "lookups": len(lookups), "lookup_us_p50": pct(0.5) if pct else None,
                "lookup_us_p99": pct(0.99) if pct else None,
                "lookup_us_mean": round(statistics.fmean(lookups) / 1e3, 2) if lookups else None,
                "apply_ms": round(self.apply_ns / 1e6, 3)}
