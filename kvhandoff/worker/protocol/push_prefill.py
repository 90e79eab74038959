"""Push, prefill side (worker/push.py drives it): a computed prompt and a decode worker's registration
meet here, in either order, and the WRITE goes out once both are in.

States (the prompt's half x the registration's half, then the WRITE):

    OPEN --prompt--> PROMPT --registered--> BOTH --computed--> WRITING --write ended--> ENDED
    OPEN --registered--> REGISTERED --prompt--> BOTH
    PROMPT --computed--> COMPUTED --registered--> WRITING

OPEN is a job a Rebind made before either half came. Any state before WRITING ends (ENDED) when the
prompt fails, the router or the registered decode worker cancels, that worker's agent dies, or one
half waits more than 2 x --kv-timeout-s for the other; a job in WRITING ends with its WRITE only (the
blocks it reads from stay pinned until then). Late binding (Rebound) withdraws the registration
while no WRITE has started and no layer has been written (`committed`), back to OPEN or PROMPT.
Keep-alive: while a registered prompt computes, Progress goes to decode at most every ttl / 3, and
only when more of the prompt was computed (push.py's docstring: the timing rule).
"""
from __future__ import annotations

from enum import Enum, auto

import msgspec

from kvhandoff.wire import messages as M
from kvhandoff.worker.protocol.actions import (
    AbortPrompt,
    Count,
    End,
    Notify,
    Refuse,
    ReleaseBlocks,
    Warn,
)

MOVED = "handoff_moved"     # the error code of a registration refused because the handoff moved on
CANCELLED = "cancelled"     # a job's end when the router or the decode side gave up
NEVER_CAME = "the other side of the handoff never arrived"


class Phase(Enum):
    OPEN = auto()           # neither half (a Rebind came first)
    PROMPT = auto()         # the prompt is being computed; no registration
    REGISTERED = auto()     # a registration; the prompt has not come
    BOTH = auto()           # registered, and the prompt is being computed
    COMPUTED = auto()       # the prompt is computed (its blocks pinned); no registration
    WRITING = auto()        # handed to the writer: its WRITE ends it
    ENDED = auto()          # written, failed or cancelled

    @property
    def has_prompt(self) -> bool:
        return self in (Phase.PROMPT, Phase.BOTH, Phase.COMPUTED, Phase.WRITING)


class Job(msgspec.Struct, frozen=True):
    handoff_id: str
    arrival: float                          # when the job began waiting for its other half
    phase: Phase = Phase.OPEN
    binding: int = 0                        # late binding: the destination registrations must name
    registration: M.Registration | None = None
    peer: str | None = None                 # the registered decode worker's agent
    prompt_hash: str | None = None
    layerwise: bool = False
    renewed_at: float = 0.0                 # decode's last word (registration or Renew): the WRITE's clock
    progress_at: float = 0.0                # our last Progress
    progress_tokens: int = 0                # how much of the prompt was computed at that Progress
    committed: bool = False                 # a layer-wise WRITE went to the registration: no rebinding
    failed: str | None = None               # why it ended, if not written

    @property
    def ttl_s(self) -> float:
        return self.registration.ttl_ms / 1000


# ---- events ----------------------------------------------------------------------------------------
class PromptArrived(msgspec.Struct, frozen=True):
    prompt_hash: str
    layerwise: bool


class Registered(msgspec.Struct, frozen=True):
    """A decode worker's registration (already checked for well-formedness)."""
    registration: M.Registration
    peer: str
    now: float


class Rebound(msgspec.Struct, frozen=True):
    binding: int
    now: float


class Computed(msgspec.Struct, frozen=True):
    """The prompt is computed and its blocks pinned."""
    now: float
    num_tokens: int


class PromptFailed(msgspec.Struct, frozen=True):
    """The prompt failed or was refused before it started."""
    reason: str


class Cancelled(msgspec.Struct, frozen=True):
    """The router gave up (`by_peer` None), or a decode worker sent Cancel."""
    by_peer: str | None = None


class PeerLost(msgspec.Struct, frozen=True):
    peer: str
    reason: str


class Renewed(msgspec.Struct, frozen=True):
    now: float


class Tick(msgspec.Struct, frozen=True):
    now: float
    computed_tokens: int        # of the prompt, by the engine so far
    timeout_s: float            # --kv-timeout-s


class LayerComputed(msgspec.Struct, frozen=True):
    """Layer-wise: a layer of the prompt is computed; from now on layers go to the registration, if any."""


class WriteEnded(msgspec.Struct, frozen=True):
    error: str | None = None


# ---- actions of its own ----------------------------------------------------------------------------
class StartWrite(msgspec.Struct, frozen=True):
    """Hand the job to the writer thread: the final WRITE and Done."""


class Finish(msgspec.Struct, frozen=True):
    """Wake the prefill's answer: the job has ended."""


# ---- the machine -----------------------------------------------------------------------------------
def step(job: Job, event) -> tuple[Job, list]:
    return _HANDLERS[type(event)](job, event)


def _prompt_arrived(job: Job, event: PromptArrived) -> tuple[Job, list]:
    if job.phase not in (Phase.OPEN, Phase.REGISTERED):
        return job, []              # ended meanwhile: its end stands, the compute finds it
    phase = Phase.BOTH if job.phase is Phase.REGISTERED else Phase.PROMPT
    return msgspec.structs.replace(job, phase=phase, prompt_hash=event.prompt_hash, layerwise=event.layerwise), []


def _registered(job: Job, event: Registered) -> tuple[Job, list]:
    reg = event.registration
    if job.phase is Phase.ENDED:
        return job, [Notify(event.peer, M.Failed(handoff_id=job.handoff_id, reason=job.failed or "ended")),
                     Refuse(f"handoff {job.handoff_id} already ended: {job.failed}")]
    if reg.binding != job.binding:      # it may hold blocks for us already: they will get nothing
        return job, [Notify(event.peer, M.Withdrawn(handoff_id=job.handoff_id)),
                     Refuse(f"handoff {job.handoff_id} was moved to another decode worker (binding {job.binding}, "
                            f"not {reg.binding})", code=MOVED)]
    if job.registration is not None:
        return job, [Refuse(f"handoff {job.handoff_id} is already registered")]
    job = msgspec.structs.replace(job, registration=reg, peer=event.peer, layerwise=reg.mode.layerwise,
                  renewed_at=event.now, progress_at=event.now)
    if job.phase is Phase.COMPUTED:
        return msgspec.structs.replace(job, phase=Phase.WRITING), [StartWrite()]
    return msgspec.structs.replace(job, phase=Phase.BOTH if job.phase is Phase.PROMPT else Phase.REGISTERED), []


def _rebound(job: Job, event: Rebound) -> tuple[Job, list]:
    if job.phase is Phase.WRITING or job.committed:
        return job, [Refuse(f"handoff {job.handoff_id}: the KV write to {job.registration.decode_worker} has started")]
    if job.phase is Phase.ENDED:
        return job, [Refuse(f"handoff {job.handoff_id} already ended: {job.failed}")]
    if event.binding <= job.binding:
        return job, [Refuse(f"handoff {job.handoff_id} is at binding {job.binding} already")]
    phase = {Phase.REGISTERED: Phase.OPEN, Phase.BOTH: Phase.PROMPT}.get(job.phase, job.phase)
    withdrawn = [Notify(job.peer, M.Withdrawn(handoff_id=job.handoff_id))] if job.peer is not None else []
    # The new registration gets the full wait (Tick).
    return msgspec.structs.replace(job, phase=phase, binding=event.binding, registration=None, peer=None, arrival=event.now), withdrawn


def _computed(job: Job, event: Computed) -> tuple[Job, list]:
    if job.phase is Phase.ENDED:
        return job, []              # nobody will write these blocks: the engine frees them
    assert job.phase in (Phase.PROMPT, Phase.BOTH), job.phase
    if job.phase is Phase.PROMPT:
        return msgspec.structs.replace(job, phase=Phase.COMPUTED), []
    # Progress is also checked as the prompt completes: its WRITE starts now and Tick skips started
    # jobs, so without it a prompt computed in one step late in the ttl left decode a sliver of its
    # deadline for the WRITE (a slow link's included) and it recomputed (issue 11, bug 4).
    job, actions = _keep_alive(job, event.now, event.num_tokens)
    return msgspec.structs.replace(job, phase=Phase.WRITING), [*actions, StartWrite()]


def _prompt_failed(job: Job, event: PromptFailed) -> tuple[Job, list]:
    return _end(job, event.reason)


def _cancelled(job: Job, event: Cancelled) -> tuple[Job, list]:
    # Once the handoff was moved (late binding), only the decode worker holding its current
    # registration speaks for it.
    if event.by_peer is not None and job.binding and event.by_peer != job.peer:
        return job, []
    return _end(job, CANCELLED, free=True)


def _peer_lost(job: Job, event: PeerLost) -> tuple[Job, list]:
    if job.peer != event.peer or job.phase in (Phase.WRITING, Phase.ENDED):
        return job, []
    return _end(job, f"KV write to {job.registration.decode_worker} failed: its agent is gone ({event.reason})",
                status=502, free=True)


def _renewed(job: Job, event: Renewed) -> tuple[Job, list]:
    return msgspec.structs.replace(job, renewed_at=event.now), []


def _tick(job: Job, event: Tick) -> tuple[Job, list]:
    if job.phase in (Phase.WRITING, Phase.ENDED):
        return job, []
    if job.phase is Phase.BOTH:     # (bound by decode's renewals instead: the WRITE's clock)
        return _keep_alive(job, event.now, event.computed_tokens)
    if event.now - job.arrival <= 2 * event.timeout_s:
        return job, []
    missing = "registration" if job.registration is None else "prompt"
    job, actions = _end(job, NEVER_CAME, release=True)
    return job, [Warn(f"handoff {job.handoff_id}: no {missing} within {2 * event.timeout_s:.0f}s, dropped"), *actions]


def _layer_computed(job: Job, event: LayerComputed) -> tuple[Job, list]:
    return (job if job.committed else msgspec.structs.replace(job, committed=job.registration is not None)), []


def _write_ended(job: Job, event: WriteEnded) -> tuple[Job, list]:
    assert job.phase is Phase.WRITING, job.phase
    failed = [Count("failures"), Notify(job.peer, M.Failed(handoff_id=job.handoff_id, reason=event.error))] \
        if event.error else []
    return msgspec.structs.replace(job, phase=Phase.ENDED, failed=event.error), \
        [*failed, End(event.error or "written"), ReleaseBlocks(), Finish()]


def _keep_alive(job: Job, now: float, computed: int) -> tuple[Job, list]:
    if job.registration is None or now - job.progress_at <= job.ttl_s / 3 or computed <= job.progress_tokens:
        return job, []
    return msgspec.structs.replace(job, progress_at=now, progress_tokens=computed), \
        [Notify(job.peer, M.Progress(handoff_id=job.handoff_id))]


def _end(job: Job, reason: str, status: int = 409, free: bool = False, release: bool = False) -> tuple[Job, list]:
    """End a job the writer has not started: tell a registered decode worker (once no layer WRITE can
    land: it frees its blocks on this word), wake the answer. `free`: release a computed prompt's
    blocks or abort its computation; `release`: only the former."""
    if job.phase in (Phase.WRITING, Phase.ENDED):
        return job, []
    actions = [End(reason, status)]
    if job.peer is not None:
        actions.append(Notify(job.peer, M.Failed(handoff_id=job.handoff_id, reason=reason),
                              after_writes=job.committed))
    if (free or release) and job.phase is Phase.COMPUTED:
        actions.append(ReleaseBlocks())
    elif free and job.phase.has_prompt:
        actions.append(AbortPrompt())
    return msgspec.structs.replace(job, phase=Phase.ENDED, failed=reason), [*actions, Finish()]


_HANDLERS = {PromptArrived: _prompt_arrived, Registered: _registered, Rebound: _rebound, Computed: _computed,
             PromptFailed: _prompt_failed, Cancelled: _cancelled, PeerLost: _peer_lost, Renewed: _renewed,
             Tick: _tick, LayerComputed: _layer_computed, WriteEnded: _write_ended}
