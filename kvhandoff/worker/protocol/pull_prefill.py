"""Pull, prefill side (worker/pull.py drives it): a prompt computed, then pinned under a lease until
the decode worker has read it (Release), the lease runs out, or the router gives up.

    COMPUTING --computed--> PINNED --released / lease expired / cancelled--> ENDED
    COMPUTING --failed / cancelled--> ENDED

A decode worker still queued for blocks keeps the lease alive (Renewed). A READ after the lease
expired gets other bytes, whose checksums disagree: decode recomputes, never garbage.
"""
from __future__ import annotations

from enum import Enum, auto

import msgspec

from kvhandoff.worker.protocol.actions import (
    AbortPrompt,
    Count,
    End,
    ReleaseBlocks,
    Warn,
)


class Phase(Enum):
    COMPUTING = auto()
    PINNED = auto()
    ENDED = auto()


class Pin(msgspec.Struct, frozen=True):
    handoff_id: str
    phase: Phase = Phase.COMPUTING
    lease_expiry: float | None = None       # set once the KV is pinned


class Computed(msgspec.Struct, frozen=True):
    """The prompt is computed and its blocks pinned by the engine."""
    now: float
    lease_s: float


class PromptFailed(msgspec.Struct, frozen=True):
    reason: str


class Released(msgspec.Struct, frozen=True):
    """Decode read the KV, or will not (Release, /kv/release)."""


class Renewed(msgspec.Struct, frozen=True):
    now: float
    lease_s: float


class Tick(msgspec.Struct, frozen=True):
    now: float


class Cancelled(msgspec.Struct, frozen=True):
    """The router gave up."""


def step(pin: Pin, event) -> tuple[Pin, list]:
    phase = pin.phase
    if phase is Phase.ENDED:
        return pin, []              # (a prompt computed after a cancel: the engine frees its blocks)
    if isinstance(event, Computed):
        return msgspec.structs.replace(pin, phase=Phase.PINNED, lease_expiry=event.now + event.lease_s), []
    if isinstance(event, PromptFailed) and phase is Phase.COMPUTING:
        return _end(pin, event.reason)
    if isinstance(event, Cancelled):
        return _end(pin, "cancelled", AbortPrompt() if phase is Phase.COMPUTING else ReleaseBlocks())
    if phase is not Phase.PINNED:
        return pin, []
    if isinstance(event, Released):
        return _end(pin, "released", ReleaseBlocks())
    if isinstance(event, Renewed):
        return msgspec.structs.replace(pin, lease_expiry=event.now + event.lease_s), []
    if isinstance(event, Tick) and pin.lease_expiry <= event.now:
        pin, actions = _end(pin, "lease expired", ReleaseBlocks())
        return pin, [Count("lease_expiries"), Warn(f"handoff {pin.handoff_id}: lease expired, blocks freed"), *actions]
    return pin, []


def _end(pin: Pin, reason: str, *then) -> tuple[Pin, list]:
    return msgspec.structs.replace(pin, phase=Phase.ENDED), [End(reason), *then]
