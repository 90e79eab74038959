"""Every transition of the protocol sides' state machines (kvhandoff/worker/protocol), from tables:
a state, an event, the state and the actions that must follow. No engine, agent, socket or thread:
the whole file runs in well under a second. The live tests (test_handoff, test_faults, test_runtime)
drive the same machines through real workers."""
from __future__ import annotations

from msgspec.structs import replace

import pytest

from kvhandoff.wire import messages as M
from kvhandoff.wire.modes import Mode
from kvhandoff.worker.protocol import arrival as A
from kvhandoff.worker.protocol import layers as L
from kvhandoff.worker.protocol import pull_prefill as PP
from kvhandoff.worker.protocol import push_prefill as S
from kvhandoff.worker.protocol import retention as R
from kvhandoff.worker.protocol.actions import Count, End, Notify, Refuse

T0 = 1000.0
DEC = "decode-agent"


def registration(binding: int = 0, mode: Mode = Mode.PUSH, ttl_ms: float = 30_000) -> M.Registration:
    return M.Registration(handoff_id="h", mode=mode, decode_worker="decode-1", agent_metadata="", block_ids=[1, 2],
                          pool_blocks=8, num_kv_tokens=40, prompt_hash="p", ttl_ms=ttl_ms, binding=binding)


def job(phase: S.Phase, **fields) -> S.Job:
    """A push job in `phase`, with what that phase implies (a registration, a prompt hash)."""
    registered = phase in (S.Phase.REGISTERED, S.Phase.BOTH, S.Phase.WRITING)
    base = S.Job("h", arrival=T0, phase=phase, prompt_hash="p" if phase.has_prompt else None,
                 registration=registration() if registered else None, peer=DEC if registered else None,
                 renewed_at=T0, progress_at=T0)
    return replace(base, **fields)


def kinds(actions: list) -> list[str]:
    """The actions as short words, for tables: Notify shows its note's kind (and `after` for after_writes)."""
    words = []
    for a in actions:
        if isinstance(a, Notify):
            words.append(f"{type(a.note).__name__}{'-after' if a.after_writes else ''}")
        elif isinstance(a, (End, Refuse, Count)):
            words.append(f"{type(a).__name__}:{getattr(a, 'reason', None) or getattr(a, 'name', None) or a.status}")
        else:
            words.append(type(a).__name__)
    return words


# ---- push, prefill side ------------------------------------------------------------------------------
CANCEL_END = f"End:{S.CANCELLED}"
PUSH_TABLE = [
    # state, event, next phase, actions
    ("prompt first", job(S.Phase.OPEN), S.PromptArrived("p", False), S.Phase.PROMPT, []),
    ("prompt after the registration", job(S.Phase.REGISTERED), S.PromptArrived("p", False), S.Phase.BOTH, []),
    ("prompt for an ended job", job(S.Phase.ENDED), S.PromptArrived("p", False), S.Phase.ENDED, []),
    ("registration first", job(S.Phase.OPEN), S.Registered(registration(), DEC, T0), S.Phase.REGISTERED, []),
    ("registration while computing", job(S.Phase.PROMPT), S.Registered(registration(), DEC, T0), S.Phase.BOTH, []),
    ("registration of a computed prompt", job(S.Phase.COMPUTED), S.Registered(registration(), DEC, T0),
     S.Phase.WRITING, ["StartWrite"]),
    ("a second registration", job(S.Phase.BOTH), S.Registered(registration(), "other", T0), S.Phase.BOTH,
     ["Refuse:409"]),
    ("a registration of an old binding", job(S.Phase.PROMPT, binding=2), S.Registered(registration(1), DEC, T0),
     S.Phase.PROMPT, ["Withdrawn", "Refuse:409"]),
    ("a registration after the end", job(S.Phase.ENDED, failed="cancelled"), S.Registered(registration(), DEC, T0),
     S.Phase.ENDED, ["Failed", "Refuse:409"]),
    ("computed, no registration", job(S.Phase.PROMPT), S.Computed(T0, 40), S.Phase.COMPUTED, []),
    ("computed and registered", job(S.Phase.BOTH), S.Computed(T0, 40), S.Phase.WRITING, ["StartWrite"]),
    ("computed late in the ttl: Progress first", job(S.Phase.BOTH, progress_at=T0 - 20), S.Computed(T0, 40),
     S.Phase.WRITING, ["Progress", "StartWrite"]),
    ("computed after a cancel", job(S.Phase.ENDED), S.Computed(T0, 40), S.Phase.ENDED, []),
    ("prompt failed, registered", job(S.Phase.BOTH), S.PromptFailed("engine error"), S.Phase.ENDED,
     ["End:engine error", "Failed", "Finish"]),
    ("prompt failed, unregistered", job(S.Phase.PROMPT), S.PromptFailed("refused"), S.Phase.ENDED,
     ["End:refused", "Finish"]),
    ("router cancels while computing", job(S.Phase.BOTH), S.Cancelled(), S.Phase.ENDED,
     [CANCEL_END, "Failed", "AbortPrompt", "Finish"]),
    ("router cancels a computed prompt", job(S.Phase.COMPUTED), S.Cancelled(), S.Phase.ENDED,
     [CANCEL_END, "ReleaseBlocks", "Finish"]),
    ("router cancels before the prompt", job(S.Phase.REGISTERED), S.Cancelled(), S.Phase.ENDED,
     [CANCEL_END, "Failed", "Finish"]),
    ("cancel while writing: the WRITE ends it", job(S.Phase.WRITING), S.Cancelled(), S.Phase.WRITING, []),
    ("decode cancels", job(S.Phase.BOTH), S.Cancelled(by_peer=DEC), S.Phase.ENDED,
     [CANCEL_END, "Failed", "AbortPrompt", "Finish"]),
    ("a moved-away decode worker's cancel", job(S.Phase.BOTH, binding=1), S.Cancelled(by_peer="old"),
     S.Phase.BOTH, []),
    ("a committed job's end waits for its layer writes", job(S.Phase.BOTH, committed=True), S.Cancelled(),
     S.Phase.ENDED, [CANCEL_END, "Failed-after", "AbortPrompt", "Finish"]),
    ("the registered decode worker dies", job(S.Phase.BOTH), S.PeerLost(DEC, "EOF"), S.Phase.ENDED,
     ["End:KV write to decode-1 failed: its agent is gone (EOF)", "Failed", "AbortPrompt", "Finish"]),
    ("another peer dies", job(S.Phase.BOTH), S.PeerLost("other", "EOF"), S.Phase.BOTH, []),
    ("a peer dies mid-WRITE: the WRITE ends it", job(S.Phase.WRITING), S.PeerLost(DEC, "EOF"), S.Phase.WRITING, []),
    ("rebind before a registration", job(S.Phase.PROMPT), S.Rebound(1, T0 + 1), S.Phase.PROMPT, []),
    ("rebind a registered prompt", job(S.Phase.BOTH), S.Rebound(1, T0 + 1), S.Phase.PROMPT, ["Withdrawn"]),
    ("rebind a registration", job(S.Phase.REGISTERED), S.Rebound(1, T0 + 1), S.Phase.OPEN, ["Withdrawn"]),
    ("rebind while writing", job(S.Phase.WRITING), S.Rebound(1, T0), S.Phase.WRITING, ["Refuse:409"]),
    ("rebind a committed job", job(S.Phase.BOTH, committed=True), S.Rebound(1, T0), S.Phase.BOTH, ["Refuse:409"]),
    ("rebind to an old binding", job(S.Phase.PROMPT, binding=3), S.Rebound(2, T0), S.Phase.PROMPT, ["Refuse:409"]),
    ("tick: the other half is late", job(S.Phase.REGISTERED), S.Tick(T0 + 61, 0, 30), S.Phase.ENDED,
     ["Warn", f"End:{S.NEVER_CAME}", "Failed", "Finish"]),
    ("tick: a computed prompt nobody registered", job(S.Phase.COMPUTED), S.Tick(T0 + 61, 40, 30), S.Phase.ENDED,
     ["Warn", f"End:{S.NEVER_CAME}", "ReleaseBlocks", "Finish"]),
    ("tick: within the wait", job(S.Phase.PROMPT), S.Tick(T0 + 59, 0, 30), S.Phase.PROMPT, []),
    ("tick: progress while computing", job(S.Phase.BOTH), S.Tick(T0 + 11, 8, 30), S.Phase.BOTH, ["Progress"]),
    ("tick: no progress, no Progress", job(S.Phase.BOTH, progress_tokens=8), S.Tick(T0 + 11, 8, 30),
     S.Phase.BOTH, []),
    ("tick: Progress at most every ttl / 3", job(S.Phase.BOTH), S.Tick(T0 + 9, 8, 30), S.Phase.BOTH, []),
    ("tick: writing", job(S.Phase.WRITING), S.Tick(T0 + 600, 0, 30), S.Phase.WRITING, []),
    ("written", job(S.Phase.WRITING), S.WriteEnded(None), S.Phase.ENDED,
     ["End:written", "ReleaseBlocks", "Finish"]),
    ("the WRITE failed", job(S.Phase.WRITING), S.WriteEnded("link down"), S.Phase.ENDED,
     ["Count:failures", "Failed", "End:link down", "ReleaseBlocks", "Finish"]),
]


@pytest.mark.parametrize("name, state, event, phase, actions", PUSH_TABLE, ids=[row[0] for row in PUSH_TABLE])
def test_push_prefill(name, state, event, phase, actions):
    after, done = S.step(state, event)
    assert (after.phase, kinds(done)) == (phase, actions)
    assert state.phase is not S.Phase.ENDED or after == state, "an ended job changes no more"


def test_push_prefill_keeps_what_a_registration_says():
    after, _ = S.step(job(S.Phase.PROMPT), S.Registered(registration(mode=Mode.PUSH_LAYERWISE), DEC, T0 + 5))
    assert (after.peer, after.layerwise, after.renewed_at, after.progress_at) == (DEC, True, T0 + 5, T0 + 5)
    after, _ = S.step(after, S.Renewed(T0 + 9))
    assert after.renewed_at == T0 + 9
    # A rebind forgets the registration and restarts the wait for the next one.
    after, _ = S.step(after, S.Rebound(1, T0 + 10))
    assert (after.registration, after.peer, after.binding, after.arrival) == (None, None, 1, T0 + 10)
    after, done = S.step(after, S.Registered(registration(1), "new-decode", T0 + 11))
    assert (after.phase, after.peer, done) == (S.Phase.BOTH, "new-decode", [])


def test_push_prefill_commits_layers_only_to_a_registration():
    unregistered, _ = S.step(job(S.Phase.PROMPT), S.LayerComputed())
    registered, _ = S.step(job(S.Phase.BOTH), S.LayerComputed())
    assert (unregistered.committed, registered.committed) == (False, True)


def test_push_prefill_a_failed_write_tells_decode_why():
    _, done = S.step(job(S.Phase.WRITING), S.WriteEnded("link down"))
    failed = next(a for a in done if isinstance(a, Notify))
    assert (failed.peer, failed.note.reason, failed.after_writes) == (DEC, "link down", False)


# ---- pull, prefill side ------------------------------------------------------------------------------
PIN = PP.Pin("h")
PINNED = PP.Pin("h", PP.Phase.PINNED, lease_expiry=T0 + 30)
ENDED_PIN = PP.Pin("h", PP.Phase.ENDED)
PULL_PREFILL_TABLE = [
    ("computed: pinned under the lease", PIN, PP.Computed(T0, 30), PP.Phase.PINNED, []),
    ("computed after a cancel", ENDED_PIN, PP.Computed(T0, 30), PP.Phase.ENDED, []),
    ("the prompt failed", PIN, PP.PromptFailed("engine"), PP.Phase.ENDED, ["End:engine"]),
    ("cancel while computing", PIN, PP.Cancelled(), PP.Phase.ENDED, ["End:cancelled", "AbortPrompt"]),
    ("cancel a pin", PINNED, PP.Cancelled(), PP.Phase.ENDED, ["End:cancelled", "ReleaseBlocks"]),
    ("released after the READ", PINNED, PP.Released(), PP.Phase.ENDED, ["End:released", "ReleaseBlocks"]),
    ("a Release before the pin", PIN, PP.Released(), PP.Phase.COMPUTING, []),
    ("a second Release", ENDED_PIN, PP.Released(), PP.Phase.ENDED, []),
    ("renewed", PINNED, PP.Renewed(T0 + 20, 30), PP.Phase.PINNED, []),
    ("tick within the lease", PINNED, PP.Tick(T0 + 29), PP.Phase.PINNED, []),
    ("the lease runs out", PINNED, PP.Tick(T0 + 30), PP.Phase.ENDED,
     ["Count:lease_expiries", "Warn", "End:lease expired", "ReleaseBlocks"]),
]


@pytest.mark.parametrize("name, state, event, phase, actions", PULL_PREFILL_TABLE,
                         ids=[row[0] for row in PULL_PREFILL_TABLE])
def test_pull_prefill(name, state, event, phase, actions):
    after, done = PP.step(state, event)
    assert (after.phase, kinds(done)) == (phase, actions)


def test_pull_prefill_renewal_moves_the_lease():
    after, _ = PP.step(PINNED, PP.Renewed(T0 + 20, 30))
    assert after.lease_expiry == T0 + 50
    assert PP.step(after, PP.Tick(T0 + 45))[0].phase is PP.Phase.PINNED


# ---- K/V arriving: pull and push decode, fetch -------------------------------------------------------
def arrival(kind: A.Kind, phase: A.Phase = A.Phase.QUEUED, **fields) -> A.Arrival:
    reserved = phase is not A.Phase.QUEUED
    base = A.Arrival("h", kind, arrival=T0, peer="prefill-agent", phase=phase,
                     reserved_at=T0 + 1 if reserved else None,
                     deadline=T0 + 31 if reserved and kind is A.Kind.PUSH else None,
                     settle_at=T0 + 61 if reserved and kind is A.Kind.PUSH else None)
    return replace(base, **fields)


def failed(reason: str = "x", **kw) -> A.Failed:
    return A.Failed(T0 + 2, reason, **kw)


PULL, PUSH, FETCH = A.Kind.PULL, A.Kind.PUSH, A.Kind.FETCH
RESERVED = A.Phase.RESERVED
ARRIVAL_TABLE = [
    # state, event, next phase, aside after, actions
    ("pull reserved: post the READ", arrival(PULL), A.Reserved(T0 + 1, 30), RESERVED, False, ["PostRead"]),
    ("fetch reserved: post the READ", arrival(FETCH), A.Reserved(T0 + 1, 30), RESERVED, False, ["PostRead"]),
    ("push reserved: register", arrival(PUSH), A.Reserved(T0 + 1, 30), RESERVED, False, ["Register"]),
    ("reserved after a failure", arrival(PULL, A.Phase.LOST), A.Reserved(T0, 30), A.Phase.LOST, False, []),
    ("arrived and verified", arrival(PULL, RESERVED), A.Arrived(7), A.Phase.LANDED, False,
     ["End:arrived", "Count:handoffs", "Landed"]),
    ("arrived wrong", arrival(PULL, RESERVED), A.Arrived(7, "bad checksums"), A.Phase.LOST, False,
     ["End:bad checksums", "Lost", "Count:failures", "Warn"]),
    ("arrived after a failure", arrival(PULL, A.Phase.LOST), A.Arrived(7), A.Phase.LOST, False, []),
    ("failed while queued: nothing to set aside", arrival(PUSH), failed(settled=False), A.Phase.LOST, False,
     ["End:x", "Lost", "Count:failures", "Warn"]),
    ("failed, a WRITE may land: aside", arrival(PUSH, RESERVED), failed(settled=False), A.Phase.LOST, True,
     ["End:x", "Lost", "Count:failures", "Warn"]),
    ("failed, settled", arrival(PUSH, RESERVED), failed(), A.Phase.LOST, False,
     ["End:x", "Lost", "Count:failures", "Warn"]),
    ("a second failure", arrival(PUSH, A.Phase.LOST), failed(), A.Phase.LOST, False, []),
    ("failed after landing", arrival(PULL, A.Phase.LANDED), failed(), A.Phase.LANDED, False, []),
    ("pull: the request ended first", arrival(PULL, RESERVED), A.RequestEnded(T0 + 2, "abort", 30), A.Phase.LEFT,
     True, ["End:the request ended (abort)", "Release"]),
    ("pull: ended while queued", arrival(PULL), A.RequestEnded(T0 + 2, "abort", 30), A.Phase.LEFT, False,
     ["End:the request ended (abort)", "Release"]),
    ("push: the request ended first", arrival(PUSH, RESERVED), A.RequestEnded(T0 + 2, "abort", 30), A.Phase.LEFT,
     True, ["End:the request ended (abort)", "Cancel"]),
    ("fetch: the prefill ended first", arrival(FETCH), A.RequestEnded(T0 + 2, "abort", 30), A.Phase.LEFT, False,
     ["End:the request ended (abort)"]),
    ("the request ended after landing", arrival(PULL, A.Phase.LANDED), A.RequestEnded(T0, "stop", 30),
     A.Phase.LANDED, False, []),
    ("push: Progress moves the deadline", arrival(PUSH, RESERVED), A.Progress(T0 + 20, 30), RESERVED, False,
     ["Renew"]),
    ("push: Progress after the end", arrival(PUSH, A.Phase.LOST), A.Progress(T0 + 20, 30), A.Phase.LOST, False, []),
    ("pull: queued past lease / 3: Renew", arrival(PULL), A.Tick(T0 + 11, 30, 30), A.Phase.QUEUED, False, ["Renew"]),
    ("pull: queued, renewed lately", arrival(PULL, renewed_at=T0 + 5), A.Tick(T0 + 11, 30, 30), A.Phase.QUEUED,
     False, []),
    ("push: past the deadline", arrival(PUSH, RESERVED), A.Tick(T0 + 32, 30, 30), A.Phase.LOST, True,
     ["Cancel", "End:no KV from the prefill worker within 30s", "Lost", "Count:failures", "Warn"]),
    ("push: within the deadline", arrival(PUSH, RESERVED), A.Tick(T0 + 30, 30, 30), RESERVED, False, []),
    ("settle blocks set aside", arrival(PUSH, A.Phase.LOST, aside=True), A.Settle(), A.Phase.LOST, False,
     ["ReleaseAside"]),
    ("settle twice", arrival(PUSH, A.Phase.LOST), A.Settle(), A.Phase.LOST, False, []),
]


@pytest.mark.parametrize("name, state, event, phase, aside, actions", ARRIVAL_TABLE, ids=[r[0] for r in ARRIVAL_TABLE])
def test_arrival(name, state, event, phase, aside, actions):
    after, done = A.step(state, event)
    assert (after.phase, after.aside, kinds(done)) == (phase, aside, actions)


def test_arrival_exactly_one_outcome():
    """Whatever order arrival, failure, the request's end and a deadline come in, the first end state
    stands, and only it tells the engine."""
    events = [A.Arrived(7), failed(), A.RequestEnded(T0 + 2, "abort", 30), A.Tick(T0 + 40, 30, 30)]
    for first in range(len(events)):
        state = arrival(PUSH, RESERVED)
        told = []
        for event in events[first:] + events[:first]:
            state, done = A.step(state, event)
            told += [a for a in done if isinstance(a, (A.Landed, A.Lost, End))]
        assert len([a for a in told if isinstance(a, End)]) == 1, (first, told)
        assert len([a for a in told if isinstance(a, (A.Landed, A.Lost))]) <= 1, (first, told)


def test_arrival_failure_policy_and_overrides():
    lost = lambda state, event: next(a for a in A.step(state, event)[1] if isinstance(a, A.Lost))
    assert lost(arrival(PULL, RESERVED, recompute=False), failed()).recompute is False     # the worker's policy
    assert lost(arrival(PULL, RESERVED, recompute=False), failed(recompute=True)).recompute is True  # the router's
    assert lost(arrival(FETCH, RESERVED, recompute=False), failed(recompute=False)).recompute is True  # always
    assert lost(arrival(PUSH, RESERVED), failed(settled=False)).settled is False


def test_arrival_timing_rule_for_set_aside_blocks():
    """Push: decode keeps blocks aside until two ttls after it last spoke; Progress moves that on."""
    state, _ = A.step(arrival(PUSH), A.Reserved(T0 + 1, 30))
    assert (state.deadline, state.settle_at) == (T0 + 31, T0 + 61)
    state, _ = A.step(state, A.Progress(T0 + 20, 30))
    assert (state.deadline, state.settle_at) == (T0 + 50, T0 + 80)
    state, done = A.step(state, A.Tick(T0 + 51, 30, 30))
    assert state.aside and state.settle_at == T0 + 80
    # Pull: a request that ended first keeps its blocks aside one timeout (a READ in flight ends by then).
    left, _ = A.step(arrival(PULL, RESERVED), A.RequestEnded(T0 + 2, "abort", 30))
    assert left.settle_at == T0 + 32


# ---- layer-wise push's plan --------------------------------------------------------------------------
GEOMETRY = L.Geometry(num_layers=4, layer_bytes=32 * 512, block_size=32)


def plan_writes(prompt_tokens: int, chunk_tokens: int, plan: L.Plan = L.Plan(), g: L.Geometry = GEOMETRY,
                first_chunk: int = 0) -> list[tuple]:
    writes = []
    for start in range(first_chunk * chunk_tokens, prompt_tokens, chunk_tokens):
        end = min(start + chunk_tokens, prompt_tokens)
        for layer in range(g.num_layers):
            plan, out = L.on_layer(plan, layer, start, end, prompt_tokens, g)
            writes += [(w.blocks.start, w.blocks.stop, w.first_layer, w.num_layers) for w in out]
    return writes


def test_layers_each_range_written_once():
    """Every (block, layer) of the prompt goes exactly once, and only once its block is complete: with
    groups of 5 layers even the last chunk goes layer by layer, its partial last block with it."""
    big = L.Geometry(num_layers=30, layer_bytes=32 * 768 * 64, block_size=32)      # groups of 5 layers
    writes = plan_writes(1000, 96, g=big)
    covered = [(b, layer) for start, stop, first, n in writes for b in range(start, stop) for layer in range(first, first + n)]
    assert sorted(covered) == [(b, layer) for b in range(32) for layer in range(30)]
    # A block goes with the chunk that completes it: block 2 (64-95) with the first chunk (0-95), block 3
    # (96-127) with the second.
    assert writes[0] == (0, 3, 0, 5) and writes[6] == (3, 6, 0, 5)


def test_layers_a_late_registration_catches_up():
    """Committed at the third chunk: the blocks completed before it go with that chunk's layers."""
    big = L.Geometry(num_layers=30, layer_bytes=32 * 768 * 64, block_size=32)
    writes = plan_writes(1000, 96, plan=L.Plan(skip_blocks=1), g=big, first_chunk=2)
    assert writes[0] == (1, 9, 0, 5)            # blocks 1-8 (block 0 decode holds already), 5 layers at a time


def test_layers_small_chunks_wait_for_a_mebibyte():
    """Tiny's 2,048-token prompt in chunks of 512 KiB, over shared memory: each WRITE costs the prefill's
    core about the same whatever its size, so a chunk under MIN_WRITE_BYTES waits for the next one's,
    and the last two go in push's final WRITE (from the plan's first unsent block on). Over a link
    every chunk goes (test_runtime.py: test_layerwise_writes_carry_at_least_a_mebibyte)."""
    tiny = L.Geometry(num_layers=4, layer_bytes=4096, block_size=16)
    plan = L.Plan(gather=True)
    writes = []
    for start in range(0, 2048, 512):
        for layer in range(4):
            plan, out = L.on_layer(plan, layer, start, start + 512, 2048, tiny)
            writes += [(w.blocks.start, w.blocks.stop, w.first_layer, w.num_layers) for w in out]
    assert writes == [(0, 64, 0, 4)]            # chunks 1 and 2, 1 MiB, after chunk 2's last layer
    assert plan.first_unsent_block == 64


@pytest.mark.parametrize("g, prompt_tokens, chunk_tokens", [
    (L.Geometry(num_layers=30, layer_bytes=32 * 768 * 64, block_size=32), 1000, 96),
    (L.Geometry(num_layers=30, layer_bytes=16 * 1536, block_size=16), 1024, 512),     # SmolLM2's
    (L.Geometry(num_layers=4, layer_bytes=4096, block_size=16), 2048, 512),          # tiny's
    (GEOMETRY, 320, 64)])
@pytest.mark.parametrize("gather", [False, True])
def test_layers_called_only_where_a_write_may_leave(g, prompt_tokens, chunk_tokens, gather):
    """The engine calls on_layer only after write_layers' layers (each call costs the engine's core):
    the writes are the same as if it had heard of every layer."""
    plan, sparse = L.Plan(skip_blocks=1, gather=gather), []
    for start in range(0, prompt_tokens, chunk_tokens):
        end = min(start + chunk_tokens, prompt_tokens)
        for layer in sorted(L.write_layers(plan, end, prompt_tokens, g)):
            plan, out = L.on_layer(plan, layer, start, end, prompt_tokens, g)
            sparse += [(w.blocks.start, w.blocks.stop, w.first_layer, w.num_layers) for w in out]
    assert sparse == plan_writes(prompt_tokens, chunk_tokens, plan=L.Plan(skip_blocks=1, gather=gather), g=g)
    assert plan.first_unsent_block == plan_first_unsent(prompt_tokens, chunk_tokens, g, gather)


def plan_first_unsent(prompt_tokens: int, chunk_tokens: int, g: L.Geometry, gather: bool) -> int:
    plan = L.Plan(skip_blocks=1, gather=gather)
    for start in range(0, prompt_tokens, chunk_tokens):
        for layer in range(g.num_layers):
            plan, _ = L.on_layer(plan, layer, start, min(start + chunk_tokens, prompt_tokens), prompt_tokens, g)
    return plan.first_unsent_block


def test_layers_group_carries_a_mebibyte():
    assert L.group(1, GEOMETRY) == -(-L.MIN_WRITE_BYTES // GEOMETRY.layer_bytes)
    assert L.group(10_000, GEOMETRY) == 1       # 4 layers / 6 writes a chunk, rounded up



# ---- retained turns (bidirectional decode side) -----------------------------------------------------
KEPT = R.Turn("r", expiry=T0 + 480)
READ = replace(KEPT, readers=1, phase=R.Phase.READ)
RELEASING = replace(KEPT, readers=1, phase=R.Phase.RELEASING)
RETENTION_TABLE = [
    ("leased", KEPT, R.Leased(), R.Phase.READ, 1, []),
    ("leased twice", READ, R.Leased(), R.Phase.READ, 2, []),
    ("a lease of a turn let go while read", RELEASING, R.Leased(), R.Phase.RELEASING, 2, []),
    ("a lease of a gone turn", replace(KEPT, phase=R.Phase.GONE), R.Leased(), R.Phase.GONE, 0, ["Refused"]),
    ("the read ends", READ, R.Unleased(), R.Phase.KEPT, 0, []),
    ("one of two reads ends", replace(READ, readers=2), R.Unleased(), R.Phase.READ, 1, []),
    ("the last read of a released turn", RELEASING, R.Unleased(), R.Phase.GONE, 0, ["FreeBlocks"]),
    ("superseded", KEPT, R.Released("superseded"), R.Phase.GONE, 0, ["Forget", "FreeBlocks", "Count:superseded"]),
    ("superseded while read", READ, R.Released("superseded"), R.Phase.RELEASING, 1, ["Forget", "Count:superseded"]),
    ("the router lets it go", KEPT, R.Released(), R.Phase.GONE, 0, ["Forget", "FreeBlocks"]),
    ("let go twice", RELEASING, R.Released(), R.Phase.RELEASING, 1, []),
    ("over the cap", KEPT, R.Released("evictions"), R.Phase.GONE, 0, ["Forget", "FreeBlocks", "Count:evictions"]),
    ("expired", KEPT, R.Expire(T0 + 480), R.Phase.GONE, 0, ["Forget", "FreeBlocks", "Count:expiries"]),
    ("not yet expired", KEPT, R.Expire(T0 + 479), R.Phase.KEPT, 0, []),
    ("expires after its read", READ, R.Expire(T0 + 500), R.Phase.READ, 1, []),
    ("the engine took the blocks", KEPT, R.Evicted(), R.Phase.GONE, 0, ["Forget", "Count:evictions"]),
    ("the engine took a released turn's blocks", replace(RELEASING, readers=0), R.Evicted(), R.Phase.GONE, 0,
     ["Count:evictions"]),
]


@pytest.mark.parametrize("name, state, event, phase, readers, actions", RETENTION_TABLE,
                         ids=[r[0] for r in RETENTION_TABLE])
def test_retention(name, state, event, phase, readers, actions):
    after, done = R.step(state, event)
    assert (after.phase, after.readers, kinds(done)) == (phase, readers, actions)


def test_retention_never_frees_blocks_under_a_reader():
    """Whatever comes while a turn is read, its blocks are freed only after the last read ended."""
    for ending in (R.Released("superseded"), R.Released(), R.Released("evictions"), R.Expire(T0 + 999)):
        turn, done = R.step(READ, ending)
        assert not any(isinstance(a, R.FreeBlocks) for a in done), ending
        turn, done = R.step(turn, R.Unleased())
        freed = any(isinstance(a, R.FreeBlocks) for a in done)
        assert freed == (turn.phase is R.Phase.GONE), (ending, turn)
