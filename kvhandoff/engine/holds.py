"""Blocks that outlive their request: one ownership table with a symmetric hold / release.

A finished request normally gives its blocks back to the pool. Three kinds of owner keep them:
- PINNED: a prefill's KV, kept for its handoff (until the decode side read it, or the WRITE into the
  decode side is done, or the lease runs out);
- SET_ASIDE: blocks reserved for incoming KV whose request is gone (aborted, given up on) while a
  transfer into them may still be under way: they return only when it settles;
- RETAINED: a finished turn's KV, kept for the conversation's next turn (evictable, least recently
  used first, unless a reverse read holds it).
The table only records ownership; the engine frees the blocks when an owner is released.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

from kvhandoff.engine.request import RetainedKV


def set_aside_owner(request_id: str) -> str:
    """Who holds a request's set-aside blocks: not the request's own id, which a request recomputed
    after its K/V was lost still needs for what it pins or retains at its end, while the old blocks
    wait for the transfer to settle. (One key for both once made a retain collide with the set-aside
    hold and killed a decode worker's engine loop in a chaos soak.)"""
    return f"{request_id}/set-aside"


class Hold(Enum):
    PINNED = "pinned"
    SET_ASIDE = "set_aside"
    RETAINED = "retained"


@dataclass
class Held:
    owner: str
    kind: Hold
    block_ids: list[int]
    retained: RetainedKV | None = None      # RETAINED: what the blocks hold


class Holdings:
    """Owner -> held blocks, in the order they were last used (oldest first). Engine thread only."""

    def __init__(self):
        self._held: OrderedDict[str, Held] = OrderedDict()

    def hold(self, owner: str, kind: Hold, block_ids: list[int], retained: RetainedKV | None = None) -> Held:
        assert owner not in self._held, f"{owner} already holds blocks"
        assert (kind is Hold.RETAINED) == (retained is not None)
        held = self._held[owner] = Held(owner, kind, list(block_ids), retained)
        return held

    def release(self, owner: str) -> Held | None:
        """Forget the owner and return what it held (its blocks are the caller's to free)."""
        return self._held.pop(owner, None)

    def get(self, owner: str, kind: Hold | None = None) -> Held | None:
        held = self._held.get(owner)
        return held if held is not None and (kind is None or held.kind is kind) else None

    def touch(self, owner: str) -> None:
        """Used now: last in line for eviction."""
        self._held.move_to_end(owner)

    def of(self, kind: Hold) -> list[Held]:
        return [h for h in self._held.values() if h.kind is kind]

    def count(self, kind: Hold) -> int:
        return sum(h.kind is kind for h in self._held.values())

    def __contains__(self, owner: str) -> bool:
        return owner in self._held
