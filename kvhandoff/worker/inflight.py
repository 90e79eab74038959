"""The table of handoffs in flight on this worker, its tombstones, the blocks set aside, and the
counters /metrics reports (docs/HANDOFF.md, "Threads").

A handoff is in the table from its first message until it ends (its state machine's End action), so
a request or notification finds what it is for. Its id then stays a tombstone for 4 x --kv-timeout-s:
a request, registration or notification that comes late for it is refused or counted, never acted
on. A decode side's handoff that ended while a transfer could still land in its blocks stays in the
set-aside list, by request id, until it settles.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from kvhandoff.worker.errors import HandoffError


class Counters:
    """What /metrics reports of the handoffs; bumped from every thread, so under a lock."""
    NAMES = ("handoffs", "failures", "lease_expiries", "late_notifications", "verify_failures", "bytes")

    def __init__(self):
        self._values = dict.fromkeys(self.NAMES, 0)
        self._lock = threading.Lock()

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class InFlight:
    """Handoff id -> its entry (one per side: pull.py's PullPin, push.py's PushJob, arrivals.py's
    Incoming), plus tombstones and the set-aside list."""

    def __init__(self, tombstone_s: float):
        self.tombstone_s = tombstone_s
        self._entries: dict[str, object] = {}
        self._ended: dict[str, tuple[str, int, float]] = {}  # id -> (why it ended, HTTP status for late comers, when)
        self._aside: dict[str, object] = {}                  # request id -> the Incoming whose blocks wait to settle
        self._lock = threading.Lock()

    def add(self, handoff_id: str, entry: object) -> object:
        with self._lock:
            self._refuse_ended(handoff_id)
            if handoff_id in self._entries:
                raise HandoffError(f"handoff {handoff_id} is already in flight here", 409)
            self._entries[handoff_id] = entry
        return entry

    def get_or_add(self, handoff_id: str, make: Callable[[], object]) -> object:
        """The entry, made now if this is the first we hear of it (push: the registration and the
        prompt arrive in either order)."""
        with self._lock:
            self._refuse_ended(handoff_id)
            entry = self._entries.get(handoff_id)
            if entry is None:
                entry = self._entries[handoff_id] = make()
            return entry

    def refuse_ended(self, handoff_id: str) -> None:
        """409 (or the status it ended with) for a request of a handoff that already ended here."""
        with self._lock:
            self._refuse_ended(handoff_id)

    def _refuse_ended(self, handoff_id: str) -> None:
        ended = self._ended.get(handoff_id)
        if ended is not None:
            raise HandoffError(f"handoff {handoff_id} already ended: {ended[0]}", ended[1])

    def get(self, handoff_id: str) -> object | None:
        return self._entries.get(handoff_id)

    def claim(self, handoff_id: str, reason: str, entry: object | None = None, status: int = 409) -> object | None:
        """End the handoff, once: the entry for whoever wins, None for everyone after (or if `entry`
        is given and no longer the one in the table). A request that comes for it later is refused
        with `status`."""
        with self._lock:
            found = self._entries.get(handoff_id)
            if found is None or (entry is not None and found is not entry):
                return None
            del self._entries[handoff_id]
            self._ended[handoff_id] = (reason, status, time.monotonic())
            return found

    def end(self, handoff_id: str, reason: str) -> None:
        """Tombstone an id nobody holds yet (a cancel that overtook its request)."""
        with self._lock:
            if handoff_id not in self._entries:
                self._ended.setdefault(handoff_id, (reason, 409, time.monotonic()))

    def ended(self, handoff_id: str) -> str | None:
        ended = self._ended.get(handoff_id)
        return None if ended is None else ended[0]

    def entries(self, cls: type) -> list:
        with self._lock:
            return [e for e in self._entries.values() if isinstance(e, cls)]

    # ---- blocks set aside until no transfer can land in them ---------------------------------------
    def put_aside(self, request_id: str, entry: object) -> None:
        with self._lock:
            self._aside[request_id] = entry

    def aside(self, request_id: str) -> object | None:
        return self._aside.get(request_id)

    def take_aside(self, request_id: str) -> None:
        with self._lock:
            self._aside.pop(request_id, None)

    def all_aside(self) -> list:
        with self._lock:
            return list(self._aside.values())

    def sweep(self, now: float) -> None:
        """Forget tombstones older than tombstone_s (the housekeeper, every tick)."""
        with self._lock:
            for handoff_id in [h for h, (_, _, when) in self._ended.items() if now - when > self.tombstone_s]:
                del self._ended[handoff_id]

    def __len__(self) -> int:
        return len(self._entries)
