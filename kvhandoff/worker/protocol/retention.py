"""A retained turn on a bidirectional decode worker (worker/reuse.py's Retention drives it): a finished
turn's KV kept for the conversation's next turn, read back by prefill workers, let go.

    KEPT --leased--> READ --last reader done--> KEPT
    KEPT --released (superseded, expired, over the cap, the router's word)--> GONE: blocks freed
    READ --released--> RELEASING --last reader done--> GONE: blocks freed then
    KEPT / READ / RELEASING --the engine took the blocks (pressure)--> GONE

A turn being read is never freed under its readers: it does not expire, the cap skips it, and the
engine's own eviction skips it (the driver keeps the engine's reader count in step).
"""
from __future__ import annotations

from enum import Enum, auto

import msgspec

from kvhandoff.worker.protocol.actions import Count


class Phase(Enum):
    KEPT = auto()
    READ = auto()           # reverse reads in flight
    RELEASING = auto()      # let go while being read: freed when the last read ends
    GONE = auto()


class Turn(msgspec.Struct, frozen=True):
    retention_id: str
    expiry: float                   # time.monotonic()
    readers: int = 0
    phase: Phase = Phase.KEPT

    @property
    def held(self) -> bool:
        """Still the conversation's: findable."""
        return self.phase in (Phase.KEPT, Phase.READ)


class Leased(msgspec.Struct, frozen=True):
    pass


class Unleased(msgspec.Struct, frozen=True):
    pass


class Released(msgspec.Struct, frozen=True):
    """Let it go: `why` is the counter it counts under (superseded, expiries, evictions), or None (the
    router said so: counted nowhere)."""
    why: str | None = None


class Expire(msgspec.Struct, frozen=True):
    now: float


class Evicted(msgspec.Struct, frozen=True):
    """The engine needed the blocks for a request and took them (they are free already)."""


# ---- actions of its own ----------------------------------------------------------------------------
class Forget(msgspec.Struct, frozen=True):
    """Drop it from what the worker says it keeps (the map routers find it in; a KV event)."""


class FreeBlocks(msgspec.Struct, frozen=True):
    """Give its blocks back to the engine's pool."""


class Refused(msgspec.Struct, frozen=True):
    """A lease asked of a turn no longer held."""


def step(turn: Turn, event) -> tuple[Turn, list]:
    phase = turn.phase
    if phase is Phase.GONE:
        return turn, [Refused()] if isinstance(event, Leased) else []
    if isinstance(event, Leased):       # (a turn let go while read stays readable until its blocks go)
        return msgspec.structs.replace(turn, readers=turn.readers + 1, phase=Phase.READ if phase is Phase.KEPT else phase), []
    if isinstance(event, Unleased):
        readers = max(0, turn.readers - 1)
        if readers > 0:
            return msgspec.structs.replace(turn, readers=readers), []
        if phase is Phase.RELEASING:        # released while it was being read
            return msgspec.structs.replace(turn, readers=0, phase=Phase.GONE), [FreeBlocks()]
        return msgspec.structs.replace(turn, readers=0, phase=Phase.KEPT), []
    if isinstance(event, Evicted):
        forget = [Forget()] if turn.held else []
        return msgspec.structs.replace(turn, phase=Phase.GONE), [*forget, Count("evictions")]
    if isinstance(event, Expire) and (phase is not Phase.KEPT or event.now < turn.expiry):
        return turn, []             # (a turn being read expires after its read: the next round)
    why = "expiries" if isinstance(event, Expire) else event.why
    if phase is Phase.RELEASING:
        return turn, []
    counted = [Count(why)] if why else []
    if phase is Phase.READ:
        return msgspec.structs.replace(turn, phase=Phase.RELEASING), [Forget(), *counted]
    return msgspec.structs.replace(turn, phase=Phase.GONE), [Forget(), FreeBlocks(), *counted]
