"""The worker handoff's own threads, besides the notification mailbox's (docs/HANDOFF.md, "Threads").

The rule they keep: nobody waits on the network while holding what the engine needs. The engine
thread only records, posts or queues; the waiting happens here.
- `writer` and `reader`: work queues for the transfers (push WRITEs, pull READs and their waits). An
  item may carry a due time (fault injection: a slow link), honoured in order.
- the housekeeper: every protocol's timers (leases, deadlines, keep-alives, tombstones, set-aside
  blocks), every HOUSEKEEPING_S.
- `blocking`: handshakes and checksums for the HTTP side, in a pool of their own, so that nothing else
  queued in asyncio's default executor can delay them; a registration from a decode worker not yet
  connected to waits for its handshake there too (`soon`), not on the mailbox's receiver thread.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from kvhandoff.worker.faults import wait_until

log = logging.getLogger("kvhandoff.handoff")

HOUSEKEEPING_S = 0.2


class DueQueue:
    """A worker thread running queued callables in order, each not before its due time."""

    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, fn: Callable[[], None], due: float = 0.0) -> None:
        self._queue.put((due, fn))

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            due, fn = item
            wait_until(due)
            try:
                fn()
            except Exception:
                log.exception("%s: %r failed", self._thread.name, fn)


class Chores:
    def __init__(self):
        self.writer, self.reader = DueQueue("kvh-writer"), DueQueue("kvh-reader")
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="kvh-http")
        self._timers: list[Callable[[float], None]] = []
        self._stop = threading.Event()
        self._housekeeper = threading.Thread(target=self._housekeep, name="kvh-housekeeper", daemon=True)

    def every_tick(self, timer: Callable[[float], None]) -> None:
        """Call `timer(now)` on the housekeeper thread every HOUSEKEEPING_S (register before start)."""
        self._timers.append(timer)

    async def blocking(self, fn: Callable, *args):
        """Run a blocking call (a handshake, checksums) off the event loop, in this pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def soon(self, fn: Callable, *args) -> None:
        """Run a blocking call in this pool from any thread, for its effects: what it raises is logged."""
        def log_failure(future) -> None:
            if future.exception() is not None:
                log.error("%r failed", fn, exc_info=future.exception())
        self.pool.submit(fn, *args).add_done_callback(log_failure)

    def start(self) -> None:
        self.writer.start()
        self.reader.start()
        self._housekeeper.start()

    def close(self) -> None:
        self._stop.set()
        self.writer.stop()
        self.reader.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _housekeep(self) -> None:
        while not self._stop.wait(HOUSEKEEPING_S):
            now = time.monotonic()
            for timer in self._timers:
                try:
                    timer(now)
                except Exception:
                    log.exception("handoff housekeeping (%r) failed", timer)
