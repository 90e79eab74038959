"""A posted READ or WRITE: its state, and the wait that turns a failure into an error naming the
peer and the operation."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum

from kvhandoff.transfer.errors import TransferError, TransferTimeout


class Op(Enum):
    READ = "read"       # pull: remote -> local
    WRITE = "write"     # push: local -> remote


class XferState(Enum):
    IN_PROGRESS = "in_progress"
    DONE = "done"
    ERROR = "error"


class Handle:
    """Finished exactly once, by whichever thread completes the work (the copy worker, a connection's
    receiver, a connection dying, or poll() itself on the nixl backend): the first finish wins."""

    def __init__(self, op: Op, peer: str, backend: str, nbytes: int, wire_descs: int,
                 poller: Callable[[Handle], None] | None = None):
        self.op, self.peer, self.backend = op, peer, backend
        self.nbytes = nbytes
        self.wire_descs = wire_descs        # coalesced descriptors that went on the wire
        self.error: str | None = None
        self.posted_at = time.perf_counter()
        self.finished_at: float | None = None
        self._state = XferState.IN_PROGRESS
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._poller = poller               # for backends that complete only when asked (nixl)
        self._on_wait: Callable[[], None] | None = None   # lets a waiting caller do the work itself (shm)

    def __repr__(self) -> str:
        return f"<Handle {self.describe()} {self._state.value}>"

    def describe(self) -> str:
        direction = "from" if self.op is Op.READ else "to"
        return f"{self.op.value.upper()} {direction} peer {self.peer!r} ({self.nbytes} bytes, {self.backend})"

    @property
    def state(self) -> XferState:
        return self.poll()

    @property
    def seconds(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.posted_at

    def poll(self) -> XferState:
        if self._poller is not None and self._state is XferState.IN_PROGRESS:
            self._poller(self)
        return self._state

    def wait(self, timeout: float | None = None) -> Handle:
        """Block until done; raise TransferError if it failed, TransferTimeout if `timeout` passes."""
        if self._on_wait is not None:
            self._on_wait()
        if self._poller is None:
            finished = self._event.wait(timeout)
        else:
            finished = self._spin(timeout)
        if not finished:
            raise TransferTimeout(f"{self.describe()} still in progress after {timeout}s")
        if self._state is XferState.ERROR:
            raise TransferError(f"{self.describe()} failed: {self.error}")
        return self

    def _spin(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        spins = 0
        while self.poll() is XferState.IN_PROGRESS:
            if deadline is not None and time.monotonic() > deadline:
                return False
            spins += 1
            # Poll hard for the first ~thousand rounds (small transfers finish in microseconds), then
            # back off so a long wait does not burn the core the transfer itself needs.
            time.sleep(0 if spins < 1000 else 0.0005)
        return True

    def _finish(self, error: str | None = None) -> bool:
        with self._lock:
            if self._state is not XferState.IN_PROGRESS:
                return False
            self.error = error
            self.finished_at = time.perf_counter()
            self._state = XferState.ERROR if error is not None else XferState.DONE
        self._event.set()
        return True
