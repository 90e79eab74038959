"""Bidirectional multi-turn reuse (docs/HANDOFF.md, "Bidirectional multi-turn reuse"), top to bottom:
retention on the decode side, decide-and-fetch on the prefill side. Works with every mode.

Decode side (Retention). A request sent with `retain` keeps its blocks when it finishes normally
(Hold.RETAINED: the K/V of prompt and answer but the answer's last token, never computed), for the
conversation's next turn. This module adds the policy around them: a time to live, a memory cap,
read leases that keep an entry in place while a prefill worker READs it back, the superseding of a
conversation's previous turn, and the counters /metrics shows. The engine evicts retained KV
(least recently used first) whenever a request needs the blocks: running requests always win.

Prefill side (ReusePrefill). The router names a candidate: where a previous turn's KV lives and the
hash chain of its tokens. `decide` checks how much of it is truly a prefix of the new prompt (an
edited history stops the match at the first differing block), then weighs fetching those blocks
(bytes / measured reverse-read bandwidth, plus the measured fixed cost of a fetch) against
recomputing the tokens this worker does not already hold (tokens / measured prefill rate). To fetch,
the prefill asks the decode worker for a read lease (/kv/retained/lease), and submits its request
with those tokens as remote K/V: the engine reserves blocks for them (taking what its own prefix
cache holds), the reader thread READs the rest, verifies and unleases, and the engine computes only
the remainder of the prompt. A fetch that fails in any way means recompute, never wrong tokens.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kvhandoff.engine.block_pool import hash_chain
from kvhandoff.engine.loop import EngineLoop
from kvhandoff.engine.request import RequestOutput, RetainedKV, SamplingParams
from kvhandoff.wire import messages as M
from kvhandoff.wire.cost import CostModel, ReuseDecision, ReuseWay, common_prefix_blocks, decide
from kvhandoff.wire.modes import FinishReason
from kvhandoff.worker.arrivals import Arrivals, Incoming
from kvhandoff.worker.chores import Chores
from kvhandoff.worker.config import HandoffConfig, RetentionConfig
from kvhandoff.worker.engine_door import EngineDoor
from kvhandoff.worker.errors import HandoffError
from kvhandoff.worker.inflight import Counters, InFlight
from kvhandoff.worker.kv_events import RETAINED, UNRETAINED
from kvhandoff.worker.mailbox import Mailbox
from kvhandoff.worker.peers import Peers
from kvhandoff.worker.protocol import arrival as A
from kvhandoff.worker.protocol import retention as R
from kvhandoff.worker.protocol.actions import Count

log = logging.getLogger("kvhandoff.handoff")


# ---------------------------------------------------------------------------------------------------
# Decode side: retention

@dataclass
class Session:
    retention_id: str
    num_tokens: int
    num_blocks: int
    nbytes: int
    expiry: float                       # time.monotonic()
    block_hashes: list[str]             # hex chain hashes of its full blocks
    key: str | None = None              # the client's session id, if it named one
    token_ids: list[int] = field(default_factory=list)     # its full blocks' tokens (published: kv_events.py)

    def stored_event(self) -> tuple:
        return (RETAINED, self.retention_id, self.key, [bytes.fromhex(h) for h in self.block_hashes], self.token_ids)

    def retained(self, now: float) -> M.Retained:
        """What a router needs to find and read it again."""
        return M.Retained(retention_id=self.retention_id, num_tokens=self.num_tokens, block_hashes=self.block_hashes,
                          expires_in_s=round(max(0.0, self.expiry - now), 3), bytes=self.nbytes, session=self.key)


class Retention:
    """Kept turns, each a small state machine (protocol/retention.py) this class drives. Threads:
    `on_retained`, `lease`, `unlease`, `release` and the engine's eviction callback run on the engine
    thread; `expire` on the housekeeper (it only posts engine calls); `find` and `stats` on any thread."""

    def __init__(self, loop: EngineLoop, cfg: RetentionConfig, block_bytes: int):
        self.loop, self.engine, self.cfg, self.block_bytes = loop, loop.engine, cfg, block_bytes
        self.sessions: OrderedDict[str, Session] = OrderedDict()      # least recently used first
        self.read_leases: dict[str, tuple[str, float]] = {}           # lease id -> (retention id, expiry)
        self.turns: dict[str, R.Turn] = {}      # every turn not gone: its state (protocol/retention.py); engine thread
        # reuse_hits / lease_misses: reverse reads granted / asked for KV no longer held (the hit rate a
        # decode worker can see); leased_bytes: what those reads were granted.
        self.counters = {"retained": 0, "expiries": 0, "evictions": 0, "superseded": 0, "reuse_hits": 0,
                         "lease_misses": 0, "leased_bytes": 0}
        self._lock = threading.Lock()
        self._lease_ids = itertools.count()
        self.engine.on_evict = self._evicted
        # What it keeps and lets go, for the worker's event publisher (worker/kv_events.py); engine thread.
        self.publish: Callable[[list[tuple]], None] | None = None

    def attach(self, mail: Mailbox, chores: Chores) -> None:
        mail.on(M.Unlease, None, lambda peer, note, _: self.loop.call(lambda: self.unlease(note.lease_id)))
        chores.every_tick(self.expire)

    # ---- engine thread --------------------------------------------------------------------------
    def on_retained(self, entry: RetainedKV, supersedes: str | None, key: str | None = None) -> dict:
        """A turn finished and the engine kept its KV: record it, drop the turn it replaces, enforce
        the cap. Returns what the router needs to find it again."""
        now = time.monotonic()
        session = Session(entry.retention_id, entry.num_tokens, len(entry.block_ids),
                          len(entry.block_ids) * self.block_bytes, now + self.cfg.ttl_s,
                          [h.hex() for h in entry.block_hashes], key,
                          entry.token_ids[:len(entry.block_hashes) * self.engine.block_size])
        with self._lock:
            self.sessions[session.retention_id] = session
            self.counters["retained"] += 1
        self.turns[session.retention_id] = R.Turn(session.retention_id, session.expiry)
        if self.publish is not None:
            self.publish([session.stored_event()])
        if supersedes and supersedes != entry.retention_id:
            self._step(supersedes, R.Released("superseded"))
        self._enforce_cap()
        return session.retained(now).to_dict()

    def _step(self, retention_id: str, event) -> list:
        """Feed the turn's machine (protocol/retention.py) one event and carry its actions out."""
        turn = self.turns.get(retention_id)
        if turn is None:
            return [R.Refused()] if isinstance(event, R.Leased) else []
        turn, actions = R.step(turn, event)
        if turn.phase is R.Phase.GONE:
            del self.turns[retention_id]
        else:
            self.turns[retention_id] = turn
        for action in actions:
            kind = type(action)
            if kind is R.Forget:
                with self._lock:
                    session = self.sessions.pop(retention_id, None)
                if session is not None and self.publish is not None:
                    self.publish([(UNRETAINED, session.retention_id, [bytes.fromhex(h) for h in session.block_hashes])])
            elif kind is R.FreeBlocks:
                self.engine.release(retention_id)
            elif kind is Count:
                with self._lock:
                    self.counters[action.name] += 1
        return actions

    def _enforce_cap(self) -> None:
        if self.cfg.max_bytes is None:
            return
        for retention_id in list(self.sessions):
            if self.retained_bytes() <= self.cfg.max_bytes:
                return
            if self.turns[retention_id].phase is R.Phase.KEPT:     # (one being read back waits)
                self._step(retention_id, R.Released("evictions"))

    def _evicted(self, retention_id: str) -> None:
        """The engine needed the blocks for a request (pressure eviction)."""
        self._step(retention_id, R.Evicted())

    def snapshot(self) -> list[tuple]:
        """Every entry kept now, as the events that stored it (the publisher's snapshot; engine thread)."""
        with self._lock:
            return [s.stored_event() for s in self.sessions.values()]

    def lease(self, retention_id: str, num_blocks: int) -> dict | None:
        """Hold an entry in place for a reverse read of its first `num_blocks` blocks; None if it is
        gone (expired, evicted, superseded) or shorter than that."""
        entry = self.engine.retained(retention_id)
        if entry is None or not 0 < num_blocks <= len(entry.block_ids) or \
                any(isinstance(a, R.Refused) for a in self._step(retention_id, R.Leased())):
            with self._lock:
                self.counters["lease_misses"] += 1
            return None
        entry.readers += 1                  # (the engine's own eviction skips a turn being read)
        self.engine.holds.touch(retention_id)              # used: evict it last
        lease_id = f"{retention_id}:{next(self._lease_ids)}"
        with self._lock:
            if retention_id in self.sessions:
                self.sessions.move_to_end(retention_id)
            self.read_leases[lease_id] = (retention_id, time.monotonic() + self.cfg.read_lease_s)
            self.counters["reuse_hits"] += 1
            self.counters["leased_bytes"] += num_blocks * self.block_bytes
        return {"lease_id": lease_id, "block_ids": entry.block_ids[:num_blocks], "num_tokens": entry.num_tokens,
                "lease_s": self.cfg.read_lease_s}

    def unlease(self, lease_id: str) -> bool:
        with self._lock:
            held = self.read_leases.pop(lease_id, None)
        if held is None:
            return False
        entry = self.engine.retained(held[0])
        if entry is not None:
            entry.readers -= 1
        self._step(held[0], R.Unleased())   # released while it was read: its blocks go now
        self._enforce_cap()                 # a cap deferred for the reader applies now
        return True

    def release(self, retention_id: str) -> bool:
        """The router says the conversation moved on (or ended): drop its KV now."""
        return bool(self._step(retention_id, R.Released()))

    # ---- housekeeper ----------------------------------------------------------------------------
    def expire(self, now: float) -> None:
        with self._lock:
            expired = [s.retention_id for s in self.sessions.values() if s.expiry <= now]
            lapsed = [lease_id for lease_id, (_, expiry) in self.read_leases.items() if expiry <= now]
        for lease_id in lapsed:
            self.loop.call(lambda lease_id=lease_id: self.unlease(lease_id))
        for retention_id in expired:
            self.loop.call(lambda rid=retention_id: self._step(rid, R.Expire(now)))

    # ---- any thread -----------------------------------------------------------------------------
    def find(self, query: M.RetainedQuery) -> dict | None:
        """The entry kept under the query's session id (the newest, should a superseded one linger),
        else the one sharing the most leading blocks with its hashes; with `matched_blocks`. None if
        nothing here matches. A router that did not serve the previous turn asks every decode worker."""
        now = time.monotonic()
        with self._lock:
            live = [s for s in self.sessions.values() if s.expiry > now]
        if query.session is not None:
            named = [s for s in live if s.key == query.session]
            best = max(named, key=lambda s: s.expiry, default=None)
            matched = 0 if best is None else common_prefix_blocks(query.block_hashes, best.block_hashes)
        else:
            scored = [(common_prefix_blocks(query.block_hashes, s.block_hashes), s.expiry, s) for s in live]
            matched, _, best = max(scored, key=lambda x: x[:2], default=(0, 0.0, None))
            best = best if matched > 0 else None
        return None if best is None else best.retained(now).to_dict() | {"matched_blocks": matched}

    def retained_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self.sessions.values())

    def stats(self) -> dict:
        with self._lock:
            return {"num_retained_sessions": len(self.sessions),
                    "retained_bytes": sum(s.nbytes for s in self.sessions.values()),
                    "num_retained_blocks": sum(s.num_blocks for s in self.sessions.values())}


def lease_retained(door: EngineDoor, peers: Peers, retention: Retention | None, request: M.LeaseRequest,
                   timeout_s: float) -> dict | None:
    """Decode side, blocking (an executor thread): hold a retained entry for a reverse read and say
    where its blocks are, with their checksums (messages.ReadLease); None if it is gone."""
    if retention is None:
        return None
    lease = door.call(lambda: retention.lease(request.retention_id, request.num_blocks)).result(timeout_s)
    if lease is None:
        return None
    # Safe off the engine thread: a leased entry's blocks are neither freed nor written.
    return M.ReadLease(checksums=door.checksums(lease["block_ids"]), agent_metadata=peers.metadata_b64(),
                       pool_blocks=door.layout.num_blocks, **lease).to_dict()


# ---------------------------------------------------------------------------------------------------
# Prefill side: decide, and fetch

class ReusePrefill:
    """Reads retained history back for a prefill (its request's remote K/V: an Incoming of kind FETCH)."""

    def __init__(self, *, door: EngineDoor, arrivals: Arrivals, peers: Peers, chores: Chores, mail: Mailbox,
                 control, cfg: HandoffConfig):
        self.door, self.arrivals, self.peers, self.chores, self.mail, self.control = door, arrivals, peers, chores, mail, control
        self.cfg = cfg.reuse
        self.kv_timeout_s = cfg.kv_timeout_s
        self.cost_model = CostModel()

    async def prepare(self, handoff_id: str, candidate: M.ReuseCandidate | None,
                      prompt_ids: list[int]) -> tuple[Incoming | None, ReuseDecision]:
        """Decide; to fetch, take a read lease on the decode worker. Returns the fetch (None: compute
        everything here) and the decision so far. Any failure here means recompute."""
        if candidate is None:
            return None, no_reuse(candidate)
        door, block_size = self.door, self.door.block_size
        hashes = hash_chain(prompt_ids, block_size)
        decision, blocks = decide(self.cfg, self.cost_model, len(prompt_ids), hashes, candidate, block_size,
                                  door.layout.block_bytes, door.cached_prefix_len(hashes))
        if not blocks:
            return None, decision
        started = time.monotonic()
        try:
            lease = await self._lease(candidate, blocks)
            remote_layout = door.layout.checked_peer(lease.pool_blocks, lease.block_ids, "the read lease", status=502)
            peer = await self.peers.peer(lease.agent_metadata)
        except HandoffError as exc:
            decision.decision, decision.reason = ReuseWay.RECOMPUTE, f"fetch failed, recomputed: {exc}"
            return None, decision
        fetch = Incoming(f"fetch:{handoff_id}", blocks * block_size, request_id=handoff_id, side=self, peer=peer,
                         remote_blocks=lease.block_ids[:blocks], remote_layout=remote_layout,
                         checksums=lease.checksums[:blocks], expects_first_token=False, kind=A.Kind.FETCH)
        fetch.extra.update(lease_id=lease.lease_id, started=started)
        return fetch, decision

    async def _lease(self, candidate: M.ReuseCandidate, num_blocks: int) -> M.ReadLease:
        try:
            status, body = await self.control.post(candidate.decode_url, "/kv/retained/lease", M.LeaseRequest(
                retention_id=candidate.retention_id, num_blocks=num_blocks))
        except ConnectionError as exc:
            raise HandoffError(f"decode worker {candidate.decode_url} unreachable: {exc}", 502) from None
        if status != 200:
            raise HandoffError(f"decode worker {candidate.decode_url} has no such retained KV any more ({status})", 410)
        try:
            lease = M.parse(M.ReadLease, body, "read lease")
        except M.MessageError as exc:
            raise HandoffError(f"decode worker {candidate.decode_url} answered a malformed {exc}", 502) from None
        if len(lease.block_ids) < num_blocks or len(lease.checksums) < num_blocks:
            raise HandoffError(f"the read lease covers {len(lease.block_ids)} blocks, not {num_blocks}", 502)
        return lease

    def post_read(self, fetch: Incoming) -> None:
        """Engine thread (the machine's PostRead at reservation): READ the rest on the reader thread."""
        fetch.transfer_started = time.monotonic()
        self.chores.reader.put(lambda: self._read(fetch))

    def _read(self, fetch: Incoming) -> None:
        try:
            handle = self.peers.read(fetch.peer, self.door.layout.block_descs(fetch.transferred_blocks),
                                     fetch.remote_layout.block_descs(fetch.remote_blocks))
            handle.wait(self.kv_timeout_s)
            fetch.bytes = handle.nbytes
            done = time.monotonic()
            fetch.transfer_s = done - fetch.transfer_started
            self.arrivals.arrived(fetch)
            if fetch.failure is None:
                self.cost_model.observe_fetch(fetch.bytes, fetch.transfer_s, done - fetch.extra["started"])
        except Exception as exc:
            self.arrivals.fail(fetch, f"reverse read from {fetch.peer} failed: {exc!r}", recompute=True)
        finally:
            self._unlease(fetch)
            self.arrivals.settle(fetch.request_id)    # the prefill ended while we read: its blocks waited for us

    def finished(self, fetch: Incoming) -> None:
        """The prefill ended: a fetch it never got to (cancelled while queued) lets its lease go."""
        if self.arrivals.ended(fetch, "the prefill ended first"):
            self._unlease(fetch)

    def _unlease(self, fetch: Incoming) -> None:
        lease_id = fetch.extra.pop("lease_id", None)
        if lease_id is not None:
            self.mail.notify(fetch.peer, M.Unlease(lease_id=lease_id))



def no_reuse(candidate: M.ReuseCandidate | None) -> ReuseDecision:
    """The decision when there is nothing to decide."""
    return ReuseDecision(ReuseWay.NONE, "no retained history named" if candidate is None
                         else "this worker runs without --bidirectional")


def reuse_report(fetch: Incoming | None, decision: ReuseDecision, block_size: int) -> dict:
    """The reuse fields of the prefill's handoff object."""
    report = {"reused_tokens": 0, "reverse_bytes": 0}
    if fetch is not None and fetch.failure is not None:
        decision.decision, decision.reason = ReuseWay.RECOMPUTE, f"fetch failed, recomputed: {fetch.failure}"
    elif fetch is not None:     # reused: what came from the decode worker (not what was cached here)
        report.update(reused_tokens=len(fetch.transferred_blocks) * block_size, reverse_bytes=fetch.bytes)
        decision.fetch_ms = round((fetch.ready_at - fetch.extra["started"]) * 1e3, 3) if fetch.ready_at else None
    report["reuse_decision"] = decision.report()
    return report


class FetchingPrefill:
    """What the prefill ends of pull and push share: the prompt computed (after reading history back,
    with --bidirectional), the prefill rate measured for the cost model, a failed prompt reported."""

    def __init__(self, *, door: EngineDoor, table: InFlight, arrivals: Arrivals, peers: Peers, chores: Chores,
                 counters: Counters, cfg: HandoffConfig, worker_name: str, reuse: ReusePrefill | None):
        self.door, self.table, self.arrivals, self.peers, self.chores = door, table, arrivals, peers, chores
        self.counters, self.cfg, self.worker_name, self.reuse = counters, cfg, worker_name, reuse

    def first_token_sent(self, handoff_id: str) -> None:
        """The prompt's first token is on its way to the router (push's final WRITE waits for it)."""

    async def compute(self, job, kv, prompt_ids: list[int], params: SamplingParams,
                      on_submitted: Callable[[], None]) -> tuple[RequestOutput, dict]:
        """(the prefill-only request's final output, the reuse fields of the answer); HandoffError if
        it did not complete. `on_submitted`: the engine took the prompt."""
        if self.reuse is None:
            job.fetch, decision = None, no_reuse(kv.reuse)
        else:
            job.fetch, decision = await self.reuse.prepare(kv.handoff_id, kv.reuse, prompt_ids)
        remote = 0
        if job.fetch is not None:
            self.table.add(job.fetch.handoff_id, job.fetch)
            remote = job.fetch.num_kv_tokens
        try:
            out = await self.door.compute(self, job, kv.handoff_id, prompt_ids, params, remote_tokens=remote,
                                          on_submitted=on_submitted)
        except ValueError as exc:
            self.fetch_ended(job)
            self.refused(kv.handoff_id, str(exc))
            raise HandoffError(str(exc), 400) from None
        except BaseException:                # cancelled (the router went away): free what we hold
            self.fetch_ended(job)
            self.cancel(job)
            raise
        if out.finish_reason != FinishReason.PREFILLED:
            failed = self.ended_by_peer(job)
            if failed:                      # ended by the other side (its agent died)
                raise HandoffError(failed, 502)
            raise HandoffError(f"prefill did not complete: {out.error or out.finish_reason}",
                               500 if out.finish_reason == FinishReason.ERROR else 503)
        report = reuse_report(job.fetch, decision, self.door.block_size)
        # The engine counts fetched blocks as cached once they land; what its own cache served is the rest.
        report["prefill_cached_tokens"] = out.num_cached_tokens - report["reused_tokens"]
        return out, report

    def fetch_ended(self, job) -> None:
        """The prefill ended: a fetch it never got to (cancelled while queued) lets its lease go."""
        if job.fetch is not None:
            self.reuse.finished(job.fetch)

    def ended_by_peer(self, job) -> str | None:
        """Why the other side ended this job before its prompt was computed (push), if it did."""
        return None

    def reserved(self, job, request, num_local_tokens: int) -> None:
        """Engine thread: blocks for the fetched history are reserved."""
        self.arrivals.reserved(job.fetch, request, num_local_tokens)

    def observe(self, out: RequestOutput) -> None:
        """The prefill rate, for the reuse cost model (with --bidirectional)."""
        if self.reuse is None:
            return
        computed = out.num_prompt_tokens - out.num_cached_tokens
        self.reuse.cost_model.observe_prefill(computed, out.num_cached_tokens, (out.timings.get("prefill_ms") or 0) / 1e3)

    def refused(self, handoff_id: str, reason: str) -> None:
        """The prefill leg was refused before it started (busy, invalid)."""
        raise NotImplementedError

    def cancel(self, job) -> None:
        raise NotImplementedError

    def start_loads(self) -> None:
        """(No loads of its own: a fetch is posted on the reader thread.)"""
