"""Notifications between workers' agents (wire/messages.py, "Worker -> worker over the agent"): sent
by a thread of their own, so that a peer whose socket stalls stalls only that thread; received by
another, decoded, and dispatched by their type and the type of the handoff they name.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from kvhandoff.transfer.agent import TransferAgent
from kvhandoff.wire import messages as M
from kvhandoff.worker.faults import Faults, wait_until
from kvhandoff.worker.inflight import Counters, InFlight

log = logging.getLogger("kvhandoff.handoff")

Handler = Callable[[str, object, object], None]        # (peer, notification, the table's entry or None)


class Mailbox:
    def __init__(self, agent: TransferAgent, table: InFlight, counters: Counters, faults: Faults):
        self.agent, self.table, self.counters, self.faults = agent, table, counters, faults
        # (notification type, type of the table entry it names, or None) -> handler
        self._handlers: dict[tuple[type, type | None], Handler] = {}
        self._outbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send_loop, name="kvh-sender", daemon=True),
                         threading.Thread(target=self._receive_loop, name="kvh-receiver", daemon=True)]

    def on(self, kind: type, entry_type: type | None, handler: Handler) -> None:
        """Dispatch notifications of `kind` that name a handoff in flight of `entry_type` (None: one
        that is not in flight, or a notification that names no handoff) to `handler`."""
        key = (kind, entry_type)
        assert key not in self._handlers, f"two handlers for {kind.__name__} on {entry_type}"
        self._handlers[key] = handler

    def notify(self, peer: str | None, note, on_sent: Callable[[], None] | None = None) -> None:
        """Queue a notification for `peer`; never waits (the sender thread sends it, then calls
        `on_sent` if it went)."""
        if peer is None:
            return
        kind = type(note).__struct_config__.tag
        if kind in self.faults.drop:
            log.warning("fault injection: %s notification for %s dropped", kind, _subject(note))
            return
        if self.faults.delay_ms > 0:
            log.warning("fault injection: %s notification delayed %.0f ms", kind, self.faults.delay_ms)
        self._outbox.put((time.monotonic() + self.faults.delay_ms / 1000, peer, note, on_sent))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self._stop.set()
        self._outbox.put(None)

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            due, peer, note, on_sent = item
            wait_until(due)
            try:
                self.agent.send_notification(peer, M.encode(note))
            except Exception as exc:        # the peer is gone: its own watchdog covers it
                log.info("notification %s to %s not sent: %s", type(note).__struct_config__.tag, peer, exc)
                continue
            if on_sent is not None:
                on_sent()

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            received = self.agent.wait_notification(timeout=0.5)
            if received is None:
                continue
            peer, raw = received
            try:
                note = M.decode_notification(raw)
            except M.MessageError as exc:
                log.warning("malformed notification from %s dropped: %s", peer, exc)
                continue
            self.dispatch(peer, note)

    def dispatch(self, peer: str, note) -> None:
        handoff_id = getattr(note, "handoff_id", None)
        entry = None if handoff_id is None else self.table.get(handoff_id)
        handler = self._handlers.get((type(note), type(entry) if entry is not None else None))
        try:
            if handler is None:
                self.counters.bump("late_notifications")
            else:
                handler(peer, note, entry)
        except Exception:
            log.exception("notification %r from %s failed", note, peer)


def _subject(note) -> str:
    return getattr(note, "handoff_id", None) or getattr(note, "lease_id", "?")
