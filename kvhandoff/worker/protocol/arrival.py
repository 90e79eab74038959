"""K/V expected from another worker (worker/arrivals.py, pull.py, push.py and reuse.py drive it): the
decode side of pull and push, and a prefill's reverse read of retained history (a fetch).

    QUEUED --reserved--> RESERVED --arrived, verified--> LANDED
    QUEUED / RESERVED --failed (a READ, verification, a deadline, the peer, the router)--> LOST
    QUEUED / RESERVED --the request ended first (client gone)--> LEFT

Exactly one of arrival, failure, deadline, cancel or peer death decides the outcome: the first event
that leaves QUEUED/RESERVED for an end state. An end reached while a transfer may still land in the
reserved blocks (`settled` False) sets them aside (Hold.SET_ASIDE); they go back on Settle: the
peer's last word (Done, Failed, Withdrawn), the end of our READ, the peer's death, or `settle_at`.

Each kind's own edges:
- PULL (pull, pull-reader): the READ is posted at reservation (PostRead). While queued for blocks,
  Renew every lease / 3 keeps the prefill's pin. A request that ends first sends Release at once and
  keeps its blocks aside until a READ in flight must have ended (one --kv-timeout-s).
- PUSH: the registration goes out at reservation (Register), with a deadline of one ttl; Progress
  from the prefill moves it on (and answers Renew); past it, Cancel, and the blocks stay aside until
  the timing rule says no WRITE can land (2 x ttl after decode last spoke). A request that ends first
  sends Cancel: the prefill answers Failed once no WRITE can land.
- FETCH: the READ is posted at reservation; any failure means recompute; no first token comes with it.
"""
from __future__ import annotations

from enum import Enum, auto

import msgspec

from kvhandoff.wire import messages as M
from kvhandoff.worker.protocol.actions import Count, End, Notify, Warn


class Kind(Enum):
    PULL = auto()
    PUSH = auto()
    FETCH = auto()


class Phase(Enum):
    QUEUED = auto()         # submitted; the engine has not reserved its blocks
    RESERVED = auto()       # blocks reserved; the K/V is on its way
    LANDED = auto()         # verified and handed to the engine
    LOST = auto()           # it will not come (or came wrong): recompute or fail
    LEFT = auto()           # the request ended before its K/V landed

    @property
    def ended(self) -> bool:
        return self in (Phase.LANDED, Phase.LOST, Phase.LEFT)


class Arrival(msgspec.Struct, frozen=True):
    handoff_id: str
    kind: Kind
    arrival: float
    peer: str | None = None
    recompute: bool = True                  # on a failure, unless its event says: the worker's policy
    phase: Phase = Phase.QUEUED
    reserved_at: float | None = None
    renewed_at: float | None = None         # pull: our last Renew
    deadline: float | None = None           # push: give up waiting for Done after this (moved by Progress)
    settle_at: float | None = None          # set-aside blocks are safe to free after this
    aside: bool = False                     # its blocks are set aside (Hold.SET_ASIDE) until Settle
    failure: str | None = None


# ---- events ----------------------------------------------------------------------------------------
class Reserved(msgspec.Struct, frozen=True):
    now: float
    timeout_s: float            # push: the registration's ttl


class Arrived(msgspec.Struct, frozen=True):
    """The bytes are in our blocks and were checked: `problem` says what was wrong with them (None: right)."""
    first_token: int | None
    problem: str | None = None


class Failed(msgspec.Struct, frozen=True):
    """The K/V will not come. `settled` False: a transfer into the blocks may still be under way."""
    now: float
    reason: str
    recompute: bool | None = None       # None: the policy (a fetch always recomputes)
    settled: bool = True
    backstop_s: float = 60.0    # set-aside blocks go back by then at the latest (2 x --kv-timeout-s)


class RequestEnded(msgspec.Struct, frozen=True):
    """The engine ended the request (the client left) before its K/V landed, or after."""
    now: float
    reason: str
    timeout_s: float


class Progress(msgspec.Struct, frozen=True):
    """Push: the prefill is still computing our prompt."""
    now: float
    timeout_s: float


class Tick(msgspec.Struct, frozen=True):
    now: float
    timeout_s: float
    lease_s: float


class Settle(msgspec.Struct, frozen=True):
    """No transfer can touch the blocks any more."""


# ---- actions of its own ----------------------------------------------------------------------------
class PostRead(msgspec.Struct, frozen=True):
    """Pull, fetch: READ the blocks from the peer."""


class Register(msgspec.Struct, frozen=True):
    """Push: send the registration to the prefill worker."""


class Landed(msgspec.Struct, frozen=True):
    """Tell the engine: the K/V is in, with the prefill's first token."""
    first_token: int | None


class Lost(msgspec.Struct, frozen=True):
    """Tell the engine: recompute or fail; `settled` False sets the blocks aside."""
    recompute: bool
    reason: str
    settled: bool


class ReleaseAside(msgspec.Struct, frozen=True):
    """Free the set-aside blocks."""


# ---- the machine -----------------------------------------------------------------------------------
def step(a: Arrival, event) -> tuple[Arrival, list]:
    return _HANDLERS[type(event)](a, event)


def _reserved(a: Arrival, event: Reserved) -> tuple[Arrival, list]:
    if a.phase is not Phase.QUEUED:
        return a, []
    a = msgspec.structs.replace(a, phase=Phase.RESERVED, reserved_at=event.now)
    if a.kind is not Kind.PUSH:
        return a, [PostRead()]
    return msgspec.structs.replace(a, deadline=event.now + event.timeout_s, settle_at=event.now + 2 * event.timeout_s), [Register()]


def _arrived(a: Arrival, event: Arrived) -> tuple[Arrival, list]:
    if event.problem is not None:
        return fail(a, Failed(0.0, event.problem))
    if a.phase.ended:
        return a, []                # failed, cancelled or timed out meanwhile: that outcome stands
    return msgspec.structs.replace(a, phase=Phase.LANDED), [End("arrived"), Count("handoffs"), Landed(event.first_token)]


def fail(a: Arrival, event: Failed) -> tuple[Arrival, list]:
    if a.phase.ended:
        return a, []
    settled = event.settled or a.reserved_at is None        # nothing reserved, nothing to set aside
    recompute = True if a.kind is Kind.FETCH else event.recompute if event.recompute is not None else a.recompute
    a = msgspec.structs.replace(a, phase=Phase.LOST, failure=event.reason)
    if not settled:                 # a backstop: the transfer's own end settles it sooner
        a = msgspec.structs.replace(a, aside=True, settle_at=a.settle_at if a.settle_at is not None else event.now + event.backstop_s)
    return a, [End(event.reason), Lost(recompute, event.reason, settled), Count("failures"),
               Warn(f"handoff {a.handoff_id}: {event.reason} ({'recompute' if recompute else 'fail'})")]


def _request_ended(a: Arrival, event: RequestEnded) -> tuple[Arrival, list]:
    if a.phase.ended:
        return a, []
    # (A request that had reserved blocks had them set aside by the engine: a transfer may be landing.)
    reserved = a.reserved_at is not None
    a = msgspec.structs.replace(a, phase=Phase.LEFT, aside=reserved,
                settle_at=(a.settle_at if a.settle_at is not None else event.now + 2 * event.timeout_s)
                if reserved else a.settle_at)
    actions: list = [End(f"the request ended ({event.reason})")]
    if a.kind is Kind.PULL:         # the prefill can let the lease go now; a READ in flight ends by then
        actions.append(Notify(a.peer, M.Release(handoff_id=a.handoff_id)))
        a = msgspec.structs.replace(a, settle_at=event.now + event.timeout_s)
    elif a.kind is Kind.PUSH:
        actions.append(Notify(a.peer, M.Cancel(handoff_id=a.handoff_id)))
    return a, actions


def _progress(a: Arrival, event: Progress) -> tuple[Arrival, list]:
    # Move the set-aside time on before the Renew goes out (the timing rule, push.py).
    if a.deadline is None or a.phase.ended:
        return a, []
    return msgspec.structs.replace(a, deadline=event.now + event.timeout_s, settle_at=event.now + 2 * event.timeout_s), \
        [Notify(a.peer, M.Renew(handoff_id=a.handoff_id))]


def _tick(a: Arrival, event: Tick) -> tuple[Arrival, list]:
    if a.phase is Phase.QUEUED and a.kind is Kind.PULL and \
            event.now - (a.renewed_at or a.arrival) > event.lease_s / 3:        # keep the prefill's pin
        return msgspec.structs.replace(a, renewed_at=event.now), [Notify(a.peer, M.Renew(handoff_id=a.handoff_id))]
    if a.phase is Phase.RESERVED and a.kind is Kind.PUSH and event.now > a.deadline:
        a, actions = fail(a, Failed(event.now, f"no KV from the prefill worker within {event.timeout_s:.0f}s",
                                    settled=False, backstop_s=2 * event.timeout_s))
        return a, [Notify(a.peer, M.Cancel(handoff_id=a.handoff_id)), *actions]
    return a, []


def _settle(a: Arrival, event: Settle) -> tuple[Arrival, list]:
    return (msgspec.structs.replace(a, aside=False), [ReleaseAside()]) if a.aside else (a, [])


_HANDLERS = {Reserved: _reserved, Arrived: _arrived, Failed: fail, RequestEnded: _request_ended,
             Progress: _progress, Tick: _tick, Settle: _settle}
