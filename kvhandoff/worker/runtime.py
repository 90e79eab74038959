"""What every handoff protocol shares: the transfer agent, the threads, one table of handoffs in flight,
the set-aside list, and the events handed to the engine (docs/HANDOFF.md, "Threads").

Threads, and the one rule: nobody here waits on the network while holding what the engine needs.
- the engine thread calls the connector's hooks (connector.py); they only record, post a transfer or
  queue a notification, never wait.
- `writer` and `reader`: work queues for the transfers (push WRITEs, pull READs and their waits).
  An item may carry a due time (fault injection: a slow link), honoured in order.
- `sender`: every outgoing notification, so a peer whose socket stalls stalls only this thread.
- `receiver`: incoming notifications, decoded (messages.py) and dispatched on their type.
- `housekeeper`: every protocol's timers (leases, deadlines, keep-alives), tombstones, set-aside blocks.
Engine mutations from any of them are events (`landed`, `lost`, `release`) that the engine polls at
the start of its next step; posting one wakes the engine loop.

The table: a handoff is in it from its first message until it ends, and whoever `claim`s it ends it,
so exactly one of arrival, failure, deadline, cancel or peer death decides its outcome. Its id then
stays a tombstone for 4 x --kv-timeout-s: a request, registration or notification that comes late for
it is refused or counted, never acted on.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import queue
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from kvhandoff.engine.holds import set_aside_owner
from kvhandoff.engine.kv_connector import KVEvents, Landed, Lost
from kvhandoff.engine.request import RequestOutput, SamplingParams
from kvhandoff.transfer.agent import TransferAgent
from kvhandoff.wire import messages as M
from kvhandoff.worker.config import HandoffConfig
from kvhandoff.worker.faults import KILL_AFTER_TOKENS, KILL_DELAY_S, wait_until
from kvhandoff.worker.kv_layout import KVLayout, block_checksums

if TYPE_CHECKING:      # (the router imports this module for its router legs: no engine, no torch)
    from kvhandoff.engine.loop import EngineLoop

log = logging.getLogger("kvhandoff.handoff")

HOUSEKEEPING_S = 0.2


class HandoffError(Exception):
    """A handoff that cannot proceed; `status` is the HTTP status the caller should answer with,
    `code` the error code that lets a worker tell one refusal from another."""

    def __init__(self, message: str, status: int = 500, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def prompt_hash(prompt_token_ids: list[int]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(prompt_token_ids)}q", *prompt_token_ids), digest_size=16).hexdigest()


class Counters:
    """What /metrics reports of the handoffs; bumped from every thread, so under a lock."""
    NAMES = ("handoffs", "failures", "lease_expiries", "late_notifications", "verify_failures", "bytes")

    def __init__(self):
        self._values = dict.fromkeys(self.NAMES, 0)
        self._lock = threading.Lock()

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class InFlight:
    """Handoff id -> its state object (one per side: pull.py, push.py, reuse.py), plus tombstones."""

    def __init__(self, tombstone_s: float):
        self.tombstone_s = tombstone_s
        self._entries: dict[str, object] = {}
        self._ended: dict[str, tuple[str, int, float]] = {}  # id -> (why it ended, HTTP status for late comers, when)
        self._lock = threading.Lock()

    def add(self, handoff_id: str, entry: object) -> object:
        with self._lock:
            self._refuse_ended(handoff_id)
            if handoff_id in self._entries:
                raise HandoffError(f"handoff {handoff_id} is already in flight here", 409)
            self._entries[handoff_id] = entry
        return entry

    def get_or_add(self, handoff_id: str, make: Callable[[], object]) -> object:
        """The entry, made now if this is the first we hear of it (push: the registration and the
        prompt arrive in either order)."""
        with self._lock:
            self._refuse_ended(handoff_id)
            entry = self._entries.get(handoff_id)
            if entry is None:
                entry = self._entries[handoff_id] = make()
            return entry

    def _refuse_ended(self, handoff_id: str) -> None:
        ended = self._ended.get(handoff_id)
        if ended is not None:
            raise HandoffError(f"handoff {handoff_id} already ended: {ended[0]}", ended[1])

    def get(self, handoff_id: str) -> object | None:
        return self._entries.get(handoff_id)

    def claim(self, handoff_id: str, reason: str, entry: object | None = None, status: int = 409) -> object | None:
        """End the handoff, once: the entry for whoever wins, None for everyone after (or if `entry`
        is given and no longer the one in the table). A request that comes for it later is refused
        with `status` (409: it was given up; 502: a peer failed it)."""
        with self._lock:
            found = self._entries.get(handoff_id)
            if found is None or (entry is not None and found is not entry):
                return None
            del self._entries[handoff_id]
            self._ended[handoff_id] = (reason, status, time.monotonic())
            return found

    def end(self, handoff_id: str, reason: str) -> None:
        """Tombstone an id nobody holds yet (a cancel that overtook its request)."""
        with self._lock:
            if handoff_id not in self._entries:
                self._ended.setdefault(handoff_id, (reason, 409, time.monotonic()))

    def ended(self, handoff_id: str) -> str | None:
        ended = self._ended.get(handoff_id)
        return None if ended is None else ended[0]

    def entries(self, cls: type) -> list:
        with self._lock:
            return [e for e in self._entries.values() if isinstance(e, cls)]

    def sweep(self, now: float) -> None:
        with self._lock:
            for handoff_id in [h for h, (_, _, when) in self._ended.items() if now - when > self.tombstone_s]:
                del self._ended[handoff_id]

    def __len__(self) -> int:
        return len(self._entries)


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


class ControlClient:
    """Authenticated HTTP from this worker to another (the serve layer provides it): get() raises
    HandoffError (502) when the worker cannot be reached or answers an error; post() returns
    (status, JSON body) and raises ConnectionError when the request may not have arrived."""

    async def get(self, url: str, path: str) -> dict:
        raise NotImplementedError

    async def post(self, url: str, path: str, body: dict) -> tuple[int, object]:
        raise NotImplementedError


class Side:
    """One protocol's end on this worker (pull.py, push.py, layerwise.py, reuse.py): what the
    engine's hooks reach, through the connector, for the requests it tracks (Runtime.track)."""

    def __init__(self, rt: "Runtime"):
        self.rt = rt

    def reserved(self, entry, request, num_local_tokens: int) -> None:
        raise AssertionError(f"{type(self).__name__} expects no remote K/V for {request.request_id}")

    def finished(self, entry, request, out: RequestOutput) -> bool:
        """The engine ended the request: keep its blocks pinned (prefill-only requests)?"""
        return False

    def start_loads(self) -> None:
        """Engine thread, once per step: post what reserved() recorded."""


@dataclass
class Incoming:
    """Decode side of one handoff, or a prefill's reverse read of retained history: where its K/V
    comes from and the blocks it lands in. Shared by pull.py, push.py and reuse.py."""
    handoff_id: str                     # its key in the table of handoffs in flight
    num_kv_tokens: int
    request_id: str = ""                # the engine request it is for (default: handoff_id)
    side: Side | None = None            # the protocol end that owns it
    peer: str | None = None
    mode: M.Mode | None = None
    remote_blocks: list[int] = field(default_factory=list)     # pull, reuse: known up front
    remote_layout: KVLayout | None = None                      # ... in the peer's pool, of this layout
    checksums: list[int] | None = None                         # pull, reuse: up front; push: with Done
    first_token: int | None = None                             # sampled by the prefill
    skip_blocks: int = 0        # leading blocks this worker holds already (its prefix cache): not moved
    block_ids: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    reserved_at: float | None = None
    renewed_at: float | None = None
    transfer_started: float | None = None
    transfer_s: float = 0.0
    ready_at: float | None = None
    deadline: float | None = None       # push: give up waiting for Done after this (moved by Progress)
    settle_at: float | None = None      # push: set-aside blocks are safe to free after this
    bytes: int = 0
    failure: str | None = None
    expects_first_token: bool = True    # a whole prompt's K/V comes with the token the prefill sampled
    extra: dict = field(default_factory=dict)       # what the owning side keeps (retain, supersedes, lease)

    def __post_init__(self):
        self.request_id = self.request_id or self.handoff_id

    @property
    def transferred_blocks(self) -> list[int]:
        """Our blocks the K/V travels into (those after the ones we had already)."""
        return self.block_ids[self.skip_blocks:]


class Runtime:
    def __init__(self, loop: EngineLoop, agent: TransferAgent, cfg: HandoffConfig, worker_name: str):
        self.loop, self.agent, self.cfg, self.worker_name = loop, agent, cfg, worker_name
        self.engine = loop.engine
        self.kv = self.engine.runner.kv_cache
        self.layout = KVLayout.of(self.kv)
        self.block_size = self.engine.block_size
        self.table = InFlight(4 * cfg.kv_timeout_s)
        self.counters = Counters()
        # Request id -> the Incoming whose blocks the engine set aside, freed at its settle_at (read
        # when checked: a Progress that moves it on keeps them aside longer), or sooner.
        self.set_aside: dict[str, Incoming] = {}
        self.control: ControlClient | None = None       # HTTP to other workers (worker/handoff.py)
        # Engine request id -> (the side its hooks go to, that side's entry for it), until it ends.
        self.requests: dict[str, tuple[Side, object]] = {}
        self._events = KVEvents()
        self._events_lock = threading.Lock()
        # (notification type, type of the table entry it names, or None) -> handler(peer, note, entry)
        self._handlers: dict[tuple[type, type | None], Callable[[str, object, object], None]] = {}
        self._timers: list[Callable[[float], None]] = []
        self._peer_lost: list[Callable[[str, str], None]] = []
        self._peer_locks: dict[str, threading.Lock] = {}
        self._peer_names: dict[str, str] = {}           # agent metadata (base64) -> its name, once connected
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.writer, self.reader = DueQueue("kvh-writer"), DueQueue("kvh-reader")
        # Handshakes and checksums for the HTTP side: a pool of their own, so that nothing else
        # queued in asyncio's default executor can delay a registration.
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="kvh-http")
        self._outbox: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=fn, name=f"kvh-{name}", daemon=True) for name, fn in
                         (("sender", self._send_loop), ("receiver", self._receive_loop),
                          ("housekeeper", self._housekeep_loop))]

    def start(self) -> None:
        """Start the threads: after every protocol has registered its handlers and timers."""
        self.agent.on_peer_lost = self._on_peer_lost
        self.writer.start()
        self.reader.start()
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self._stop.set()
        self.writer.stop()
        self.reader.stop()
        self._outbox.put(None)
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def blocking(self, fn: Callable, *args):
        """Run a blocking call (a handshake, checksums) off the event loop, in this runtime's pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- what protocols register ----------------------------------------------------------------
    def on(self, kind: type, entry_type: type | None, handler: Callable[[str, object, object], None]) -> None:
        """Dispatch notifications of `kind` that name a handoff in flight of `entry_type` (None: one
        that is not in flight, or a notification that names no handoff) to `handler`."""
        key = (kind, entry_type)
        assert key not in self._handlers, f"two handlers for {kind.__name__} on {entry_type}"
        self._handlers[key] = handler

    def every_tick(self, timer: Callable[[float], None]) -> None:
        self._timers.append(timer)

    def on_peer_lost(self, handler: Callable[[str, str], None]) -> None:
        self._peer_lost.append(handler)

    # ---- events for the engine ------------------------------------------------------------------
    def landed(self, handoff_id: str, first_token: int | None = None) -> None:
        self._post(lambda e: e.landed.append(Landed(handoff_id, first_token)))

    def lost(self, handoff_id: str, recompute: bool, reason: str, settled: bool = True) -> None:
        self._post(lambda e: e.lost.append(Lost(handoff_id, recompute, reason, settled)))

    def release(self, owner: str) -> None:
        """Free the blocks `owner` holds on this worker (a pin, a set-aside reservation)."""
        self._post(lambda e: e.release.append(owner))

    def _post(self, add: Callable[[KVEvents], None]) -> None:
        with self._events_lock:
            add(self._events)
        self.loop.wake()

    def poll(self) -> KVEvents:
        with self._events_lock:
            events, self._events = self._events, KVEvents()
        return events

    def has_events(self) -> bool:
        return bool(self._events)

    # ---- peers and notifications ----------------------------------------------------------------
    async def peer(self, metadata_b64: str) -> str:
        """The connected agent `metadata_b64` describes (asyncio): a known one at once, a new one after
        its handshake on an executor thread. (Every handoff names its peer: the hop to a thread and back
        cost each one a thread wake-up and two GIL hand-offs, on the prefill's own core, while its
        prompt computed.)"""
        name = self._peer_names.get(metadata_b64)
        if name is not None and name in self.agent.peers:
            return name
        name = await self.blocking(self.ensure_peer, metadata_b64)
        if len(self._peer_names) > 1024:        # (metadata of agents long gone)
            self._peer_names.clear()
        self._peer_names[metadata_b64] = name
        return name

    def ensure_peer(self, metadata_b64: str) -> str:
        """Connect to (and authenticate) the agent described by `metadata_b64`. Blocking: call it
        from an executor, never the engine thread. Concurrent first requests to one peer wait for a
        single handshake: a second add_peer would replace the connection and fail its transfers."""
        try:
            metadata = base64.b64decode(metadata_b64, validate=True)
            name = json.loads(metadata)["name"]
        except (ValueError, KeyError, TypeError):
            raise HandoffError("malformed agent metadata in the handoff", 400) from None
        with self._lock:
            peer_lock = self._peer_locks.setdefault(name, threading.Lock())
        with peer_lock:
            if name in self.agent.peers:
                return name
            try:
                return self.agent.add_peer(metadata)
            except Exception as exc:
                raise HandoffError(f"cannot connect to the KV agent {name!r}: {exc}", 502) from None

    def metadata_b64(self) -> str:
        return base64.b64encode(self.agent.metadata()).decode()

    def notify(self, peer: str | None, note) -> None:
        """Queue a notification for `peer`; never waits (the sender thread sends it)."""
        if peer is None:
            return
        faults = self.cfg.faults
        kind = type(note).__struct_config__.tag
        if kind in faults.drop:
            log.warning("fault injection: %s notification for %s dropped", kind, _subject(note))
            return
        if faults.delay_ms > 0:
            log.warning("fault injection: %s notification delayed %.0f ms", kind, faults.delay_ms)
        self._outbox.put((time.monotonic() + faults.delay_ms / 1000, peer, note))

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            due, peer, note = item
            wait_until(due)
            try:
                self.agent.send_notification(peer, M.encode(note))
            except Exception as exc:        # the peer is gone: its own watchdog covers it
                log.info("notification %s to %s not sent: %s", type(note).__struct_config__.tag, peer, exc)

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

    def _on_peer_lost(self, peer: str, reason: str) -> None:
        """The agent saw a peer's connection die: every handoff with it ends now, not at its deadline."""
        for handler in self._peer_lost:
            handler(peer, reason)
        with self._lock:
            aside = [rid for rid, incoming in self.set_aside.items() if incoming.peer == peer]
        for request_id in aside:            # a dead writer writes no more
            self.settle(request_id)

    # ---- the decode side's shared ends: K/V landed, or lost -------------------------------------
    def arrived(self, incoming: Incoming) -> None:
        """The bytes are in our blocks: verify them, then let the engine use them (or recompute)."""
        if incoming.expects_first_token and not self.is_token(incoming.first_token):
            self.fail(incoming, f"the prefill sent no valid first token ({incoming.first_token!r})")
            return
        started = time.monotonic()
        if self.cfg.faults.verify_ms:
            time.sleep(self.cfg.faults.verify_ms / 1000)
        got = block_checksums(self.kv, incoming.transferred_blocks)
        incoming.transfer_s += time.monotonic() - started       # verification is part of the transfer
        if got != incoming.checksums:
            self.counters.bump("verify_failures")
            bad = sum(a != b for a, b in zip(got, incoming.checksums or []))
            self.fail(incoming, f"KV failed verification ({bad} of {len(got)} blocks differ; the lease may "
                                f"have expired)")
            return
        if self.table.claim(incoming.handoff_id, "arrived", incoming) is None:
            return          # failed, cancelled or timed out meanwhile: that outcome stands
        incoming.ready_at = time.monotonic()
        self.counters.bump("handoffs")
        self.counters.bump("bytes", incoming.bytes)
        self.landed(incoming.request_id, incoming.first_token)

    def fail(self, incoming: Incoming, reason: str, settled: bool = True, recompute: bool | None = None) -> bool:
        """The K/V of this handoff will not come (or came wrong): recompute or fail by policy (or as
        `recompute` says). `settled=False`: a transfer into its blocks may still be under way, so
        they stay aside until the settle time, a late Done/Failed, or the peer's death. False if
        another outcome had already claimed it."""
        settled = settled or incoming.reserved_at is None        # nothing reserved, nothing to set aside
        recompute = self.cfg.recompute if recompute is None else recompute
        # The engine's word goes out under the claim's lock: a settle that follows at once posts its
        # release after it, not before the blocks are set aside.
        if not self.claim(incoming, reason, set_aside=not settled,
                          then=lambda: self.lost(incoming.request_id, recompute, reason, settled)):
            return False
        incoming.failure = reason
        self.counters.bump("failures")
        log.warning("handoff %s: %s (%s)", incoming.handoff_id, reason, "recompute" if recompute else "fail")
        return True

    def claim(self, incoming: Incoming, reason: str, set_aside: bool, then: Callable[[], None] | None = None) -> bool:
        """End the handoff (False if another outcome had claimed it), then run `then`. `set_aside`:
        the engine keeps its reserved blocks aside (Hold.SET_ASIDE) until no transfer can land in them
        any more (settle). Recorded under the same lock as the claim: the word that settles them (a
        late Done, the end of our READ) finds the handoff claimed only once it can also find it set
        aside; in between, a chaos soak saw the word go unheard and the blocks wait out the settle time."""
        with self._lock:
            if self.table.claim(incoming.handoff_id, reason, incoming) is None:
                return False
            if set_aside:
                if incoming.settle_at is None:      # a backstop: the transfer's own end settles it sooner
                    incoming.settle_at = time.monotonic() + 2 * self.cfg.kv_timeout_s
                self.set_aside[incoming.request_id] = incoming
            if then is not None:
                then()
            return True

    def settle(self, request_id: str) -> bool:
        """No transfer can touch this request's set-aside blocks any more: free them."""
        with self._lock:
            known = self.set_aside.pop(request_id, None) is not None
        if known:
            self.release(set_aside_owner(request_id))
        return known

    def refuse_ended(self, handoff_id: str) -> None:
        """409 for a request of a handoff that already ended here (a cancel that overtook it)."""
        ended = self.table.ended(handoff_id)
        if ended is not None:
            raise HandoffError(f"handoff {handoff_id} already ended: {ended}", 409)

    def is_token(self, token) -> bool:
        return isinstance(token, int) and not isinstance(token, bool) and \
            0 <= token < self.engine.model_config.vocab_size

    def checksums(self, block_ids: list[int]) -> list[int]:
        return block_checksums(self.kv, block_ids)

    def peer_layout(self, pool_blocks: int, block_ids: list[int], what: str, status: int = 400) -> KVLayout:
        """The layout of a peer's pool of `pool_blocks` blocks, whose `block_ids` (named in `what`) must
        lie in it: a HandoffError (`status`) otherwise. (Every byte of a transfer is also checked
        against the peer's region by the agents; this catches ids that would land in another layer.)"""
        if pool_blocks < 1:
            raise HandoffError(f"{what} names a pool of {pool_blocks} blocks", status)
        layout = self.layout.peer(pool_blocks)
        bad = layout.out_of_range(block_ids)
        if bad is not None:
            raise HandoffError(f"{what} names block {bad}, outside its pool of {pool_blocks} blocks", status)
        return layout

    # ---- submitting to the engine ---------------------------------------------------------------
    def submit(self, side: Side, entry, request_id: str, prompt_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None], **options) -> None:
        """Queue a request whose engine hooks go to `side` (EngineLoop.submit options). ValueError,
        for the client, if the engine can never serve it."""
        self.requests[request_id] = (side, entry)
        try:
            self.loop.submit(request_id, prompt_ids, params, on_output, **options)
        except BaseException:
            self.requests.pop(request_id, None)
            raise

    async def compute(self, side: Side, entry, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      remote_tokens: int = 0) -> RequestOutput:
        """A prefill-only request, awaited (asyncio): its final output. Cancelling the await (the
        router went away) does not abort it: the caller's cancel does."""
        aio = asyncio.get_running_loop()
        done = aio.create_future()

        def on_output(out: RequestOutput) -> None:      # engine thread
            if out.finished:
                aio.call_soon_threadsafe(lambda: done.done() or done.set_result(out))
        self.submit(side, entry, request_id, prompt_ids, params, on_output, prefill_only=True,
                    remote_tokens=remote_tokens)
        return await done

    # ---- housekeeping ---------------------------------------------------------------------------
    def _housekeep_loop(self) -> None:
        while not self._stop.wait(HOUSEKEEPING_S):
            now = time.monotonic()
            for timer in self._timers:
                try:
                    timer(now)
                except Exception:
                    log.exception("handoff housekeeping (%r) failed", timer)
            self.table.sweep(now)
            with self._lock:
                due = [rid for rid, incoming in self.set_aside.items() if now >= (incoming.settle_at or 0)]
            for request_id in due:
                self.settle(request_id)


def _subject(note) -> str:
    return getattr(note, "handoff_id", None) or getattr(note, "lease_id", "?")



class DecodeSide(Side):
    """What the decode ends of pull and push share: the request queued for its K/V, the report on its
    final output, retention (bidirectional), and the ends every handoff can meet on this side: the
    router's /kv/failed and /kv/cancel, the request ending first, the prefill's agent dying."""

    def __init__(self, rt: Runtime):
        super().__init__(rt)
        self.retention = None       # reuse.Retention, with --bidirectional
        rt.on_peer_lost(self._peer_lost)

    def submit(self, kv, incoming: Incoming, prompt_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None]) -> None:
        incoming.side = self
        incoming.extra["supersedes"], incoming.extra["session"] = kv.supersedes, kv.session
        self.rt.table.add(kv.handoff_id, incoming)
        faults = self.rt.cfg.faults

        def with_faults(out: RequestOutput) -> None:       # engine thread
            if out.num_output_tokens >= KILL_AFTER_TOKENS:
                faults.reached("decode", kv.handoff_id, delay_s=KILL_DELAY_S)
            on_output(out)
        try:
            self.rt.submit(self, incoming, kv.handoff_id, prompt_ids, params, with_faults,
                           remote_tokens=len(prompt_ids), retain=kv.retain and self.retention is not None)
        except ValueError as exc:
            self.rt.table.claim(kv.handoff_id, str(exc), incoming)
            raise HandoffError(str(exc), 400) from None

    def note_reserved(self, incoming: Incoming, request, num_local_tokens: int) -> None:
        incoming.block_ids, incoming.reserved_at = list(request.block_table), time.monotonic()
        incoming.skip_blocks = num_local_tokens // self.rt.block_size

    def finished(self, incoming: Incoming, request, out: RequestOutput) -> bool:
        """Engine thread: annotate the final output with the handoff's report. A request that ended
        before its K/V landed (the client left) ends its handoff too."""
        # (A request that had reserved blocks had them set aside by the engine: a transfer may be landing.)
        reserved = incoming.reserved_at is not None
        if self.rt.claim(incoming, f"the request ended ({out.finish_reason})", set_aside=reserved):
            self.ended_early(incoming)
        out.handoff = self.report(incoming, out)
        if out.retained is not None and self.retention is not None:     # (a failed turn keeps the previous one)
            out.handoff["retained"] = self.retention.on_retained(out.retained, incoming.extra["supersedes"],
                                                                  incoming.extra["session"])
        return False

    def ended_early(self, incoming: Incoming) -> None:
        """Tell the prefill side that nobody wants this handoff's K/V any more."""

    def report_transfer(self, incoming: Incoming) -> float | None:
        """The transfer phase as this side measured it (None: the other side measures it)."""
        return None

    def report(self, incoming: Incoming, out: RequestOutput) -> dict:
        t = out.timings or {}
        phases: dict = {}
        if incoming.reserved_at is not None:
            phases["handoff_wait"] = ms(incoming.reserved_at - incoming.arrival)
        if (transfer := self.report_transfer(incoming)) is not None:
            phases["transfer"] = transfer
        if incoming.ready_at is not None:
            phases["decode_queue"] = t.get("decode_queue_ms")
            phases["first_step"] = t.get("first_step_ms")       # the decode's first step makes the 2nd token
        report = M.DecodeReport(
            handoff_id=incoming.handoff_id, mode=incoming.mode, decode_worker=self.rt.worker_name,
            bytes_transferred=incoming.bytes, blocks=len(incoming.transferred_blocks),
            decode_cached_tokens=incoming.skip_blocks * self.rt.block_size,
            kv_source="remote" if incoming.failure is None else "recomputed", phases_ms=phases, error=incoming.failure)
        return report.to_dict()

    def fail_reported(self, incoming: Incoming, reason: str, settled: bool, recompute: bool | None) -> bool:
        """The router saw the prefill leg fail (/kv/failed)."""
        return self.rt.fail(incoming, f"router reported: {reason}", settled=settled, recompute=recompute)

    def cancel(self, incoming: Incoming) -> None:
        """The router gave up on the request: end it (its stream is closed too); finished() does the rest."""
        self.rt.loop.abort(incoming.request_id)

    def _peer_lost(self, peer: str, reason: str) -> None:
        for incoming in self.rt.table.entries(Incoming):
            if incoming.side is self and incoming.peer == peer:
                self.rt.fail(incoming, f"prefill worker's agent {peer!r} is gone ({reason})")
