"""Decode side of bidirectional reuse: keep each finished turn's KV for the conversation's next turn.

The engine holds the blocks (LLMEngine.retained, evicted least recently used first whenever a request
needs room: running requests always win); this module adds the policy around them: a time to live,
a memory cap, read leases that keep an entry in place while a prefill worker READs it back, the
superseding of a conversation's previous turn, and the counters /metrics shows.

Threads: `on_retained`, `lease`, `unlease` and the engine's eviction callback run on the engine
thread; `expire` on the connector's housekeeper (it only posts engine calls); `stats` on any thread.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvhandoff.engine.loop import EngineLoop
from kvhandoff.engine.request import RetainedKV


@dataclass
class RetentionConfig:
    ttl_s: float = 480.0
    max_bytes: int | None = None        # None: no cap of its own (the pool's size still bounds it)
    read_lease_s: float = 15.0          # a reverse read that has not reported back by then lost its lease

    def __post_init__(self):
        assert self.ttl_s > 0 and self.read_lease_s > 0
        assert self.max_bytes is None or self.max_bytes >= 0


@dataclass
class Session:
    retention_id: str
    num_tokens: int
    num_blocks: int
    nbytes: int
    expiry: float                       # time.monotonic()
    block_hashes: list[str]             # hex chain hashes of its full blocks


class Retention:
    def __init__(self, loop: EngineLoop, cfg: RetentionConfig, block_bytes: int):
        self.loop, self.engine, self.cfg, self.block_bytes = loop, loop.engine, cfg, block_bytes
        self.sessions: OrderedDict[str, Session] = OrderedDict()      # least recently used first
        self.read_leases: dict[str, tuple[str, float]] = {}           # lease id -> (retention id, expiry)
        self.counters = {"retained": 0, "expiries": 0, "evictions": 0, "superseded": 0, "reuse_hits": 0}
        self._lock = threading.Lock()
        self._lease_ids = itertools.count()
        self.engine.on_evict = self._evicted

    # ---- engine thread --------------------------------------------------------------------------
    def on_retained(self, entry: RetainedKV, supersedes: str | None) -> dict:
        """A turn finished and the engine kept its KV: record it, drop the turn it replaces, enforce
        the cap. Returns what the router needs to find it again."""
        session = Session(entry.retention_id, entry.num_tokens, len(entry.block_ids),
                          len(entry.block_ids) * self.block_bytes, time.monotonic() + self.cfg.ttl_s,
                          [h.hex() for h in entry.block_hashes])
        with self._lock:
            self.sessions[session.retention_id] = session
            self.counters["retained"] += 1
        if supersedes and supersedes != entry.retention_id and self._release(supersedes):
            self.counters["superseded"] += 1
        self._enforce_cap()
        return {"retention_id": session.retention_id, "num_tokens": session.num_tokens,
                "block_hashes": session.block_hashes, "expires_in_s": self.cfg.ttl_s, "bytes": session.nbytes}

    def _enforce_cap(self) -> None:
        if self.cfg.max_bytes is None:
            return
        for retention_id in list(self.sessions):
            if self.retained_bytes() <= self.cfg.max_bytes:
                return
            entry = self.engine.retained.get(retention_id)
            if entry is not None and entry.readers > 0:
                continue                    # being read back right now
            if self._release(retention_id):
                self.counters["evictions"] += 1

    def _release(self, retention_id: str) -> bool:
        """Forget an entry and free its blocks; blocks under a reverse read are freed when it ends."""
        with self._lock:
            known = self.sessions.pop(retention_id, None) is not None
        entry = self.engine.retained.get(retention_id)
        if entry is not None and entry.readers > 0:
            return True                     # unlease() frees it
        return self.engine.release_retained(retention_id) or known

    def _evicted(self, retention_id: str) -> None:
        """The engine needed the blocks for a request (pressure eviction)."""
        with self._lock:
            self.sessions.pop(retention_id, None)
        self.counters["evictions"] += 1

    def lease(self, retention_id: str, num_blocks: int) -> dict | None:
        """Hold an entry in place for a reverse read of its first `num_blocks` blocks; None if it is
        gone (expired, evicted, superseded) or shorter than that."""
        entry = self.engine.retained.get(retention_id)
        if entry is None or not 0 < num_blocks <= len(entry.block_ids):
            return None
        entry.readers += 1
        self.engine.retained.move_to_end(retention_id)      # used: evict it last
        lease_id = f"{retention_id}:{next(self._lease_ids)}"
        with self._lock:
            self.sessions.move_to_end(retention_id)
            self.read_leases[lease_id] = (retention_id, time.monotonic() + self.cfg.read_lease_s)
            self.counters["reuse_hits"] += 1
        return {"lease_id": lease_id, "block_ids": entry.block_ids[:num_blocks], "num_tokens": entry.num_tokens,
                "lease_s": self.cfg.read_lease_s}

    def unlease(self, lease_id: str) -> bool:
        with self._lock:
            held = self.read_leases.pop(lease_id, None)
        if held is None:
            return False
        entry = self.engine.retained.get(held[0])
        if entry is not None:
            entry.readers -= 1
            with self._lock:
                forgotten = held[0] not in self.sessions
            if forgotten and entry.readers == 0:        # released while it was being read
                self.engine.release_retained(held[0])
        self._enforce_cap()                 # a cap deferred for the reader applies now
        return True

    def release(self, retention_id: str) -> bool:
        """The router says the conversation moved on (or ended): drop its KV now."""
        return self._release(retention_id)

    # ---- housekeeper ----------------------------------------------------------------------------
    def expire(self, now: float) -> None:
        with self._lock:
            expired = [s.retention_id for s in self.sessions.values() if s.expiry <= now]
            lapsed = [lease_id for lease_id, (_, expiry) in self.read_leases.items() if expiry <= now]
        for lease_id in lapsed:
            self.loop.call(lambda lease_id=lease_id: self.unlease(lease_id))
        for retention_id in expired:
            self.loop.call(lambda rid=retention_id: self._expired(rid))

    def _expired(self, retention_id: str) -> None:
        entry = self.engine.retained.get(retention_id)
        if entry is not None and entry.readers > 0:
            return                          # after the read: its lease ends soon, then the next round
        if self._release(retention_id):
            self.counters["expiries"] += 1

    # ---- any thread -----------------------------------------------------------------------------
    def retained_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self.sessions.values())

    def stats(self) -> dict:
        with self._lock:
            return {"num_retained_sessions": len(self.sessions),
                    "retained_bytes": sum(s.nbytes for s in self.sessions.values()),
                    "num_retained_blocks": sum(s.num_blocks for s in self.sessions.values())}
