"""Leases on pinned KV: a prefill worker keeps a finished prompt's blocks only until the decode side
releases them or the lease runs out (renewed by the decode side while it queues)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Lease:
    handoff_id: str
    block_ids: list[int]
    expiry: float           # time.monotonic() deadline


class LeaseTable:
    """Thread-safe: HTTP handlers, the notification thread and the reaper all touch it."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def pin(self, handoff_id: str, block_ids: list[int]) -> Lease:
        lease = Lease(handoff_id, list(block_ids), time.monotonic() + self.ttl_s)
        with self._lock:
            assert handoff_id not in self._leases, f"handoff {handoff_id} pinned twice"
            self._leases[handoff_id] = lease
        return lease

    def renew(self, handoff_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(handoff_id)
            if lease is not None:
                lease.expiry = time.monotonic() + self.ttl_s
            return lease is not None

    def release(self, handoff_id: str) -> Lease | None:
        """Remove and return the lease (None if it already expired or was released)."""
        with self._lock:
            return self._leases.pop(handoff_id, None)

    def expire(self, now: float | None = None) -> list[Lease]:
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [lease for lease in self._leases.values() if lease.expiry <= now]
            for lease in gone:
                del self._leases[lease.handoff_id]
        return gone

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
