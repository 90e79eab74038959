"""What the state machines ask of their drivers, as plain values (the protocol package's common words).

A driver carries a step's actions out in order while it still holds the entry's lock. None of them
waits (each queues: a notification for the sender thread, a WRITE for the writer, an event for the
engine), and holding the lock keeps what another thread does next after them: the release of
set-aside blocks can never overtake the word that set them aside.
"""
from __future__ import annotations

import msgspec


class Notify(msgspec.Struct, frozen=True):
    """A notification (wire/messages.py) to a peer's agent; nothing if `peer` is None."""
    peer: str | None
    note: object
    after_writes: bool = False      # push-layerwise: once the layer WRITEs already posted are in


class End(msgspec.Struct, frozen=True):
    """The handoff leaves the table of handoffs in flight: a request, registration or notification that
    comes for it later is refused with `status` (409: given up; 502: a peer failed it) or counted."""
    reason: str
    status: int = 409


class Refuse(msgspec.Struct, frozen=True):
    """The request that brought the event is refused (the driver raises HandoffError)."""
    message: str
    status: int = 409
    code: str | None = None


class Count(msgspec.Struct, frozen=True):
    """Bump a handoff counter (/metrics)."""
    name: str


class Warn(msgspec.Struct, frozen=True):
    """A line for the worker's log."""
    message: str


class ReleaseBlocks(msgspec.Struct, frozen=True):
    """Free the blocks the engine holds under the handoff's id (a computed prompt's pin)."""


class AbortPrompt(msgspec.Struct, frozen=True):
    """Abort the engine request computing the handoff's prompt (it ends, and its blocks with it)."""
