"""One worker's end of every handoff (docs/HANDOFF.md): pull, pull-reader, push, push-layerwise.

Threads and who does what:
- the engine thread (EngineLoop) only posts: it reserves blocks, posts pull READs (mode "pull"), and
  queues layer-wise pieces for the writer. It never waits on the network.
- the writer thread (prefill side, push modes) matches registrations with computed prompts, in either
  order, WRITEs, and sends `done` with the checksums.
- the reader thread (decode side) waits for READs to finish, and in mode "pull-reader" posts them too.
- the notification thread receives the peers' messages (done, failed, renew, release, cancel).
- the housekeeper expires leases, fires watchdogs and returns set-aside blocks after their deadline.
Every engine mutation from these threads goes through loop.call(), so the engine stays single-threaded.

Timing rule for push (why set-aside blocks can be freed without hearing from a silent peer): a
registration carries `ttl_ms`; prefill starts no WRITE later than ttl after receiving it, and decode
sets its blocks aside until 2 x ttl after sending it. A transfer into them can only happen in between.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import queue
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvhandoff.engine.loop import EngineLoop
from kvhandoff.engine.request import RequestOutput, SamplingParams
from kvhandoff.handoff.faults import KILL_AFTER_TOKENS, KILL_DELAY_S, Faults
from kvhandoff.handoff.kv_layout import KVLayout, block_checksums
from kvhandoff.handoff.leases import LeaseTable
from kvhandoff.handoff.retention import Retention, RetentionConfig
from kvhandoff.handoff.reuse import CostModel, ReuseConfig
from kvhandoff.transfer.agent import TransferAgent
from kvhandoff.transfer.errors import TransferError

log = logging.getLogger(__name__)

PULL_MODES = ("pull", "pull-reader")
LAYER_WRITES_PER_CHUNK = 6      # push-layerwise: writes per prefill chunk (SmolLM2's 30 layers: 5 at a time)
PUSH_MODES = ("push", "push-layerwise")
MODES = PULL_MODES + PUSH_MODES


class HandoffError(Exception):
    """A handoff that cannot proceed; `status` is the HTTP status the caller should answer with."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass
class HandoffConfig:
    lease_s: float = 30.0               # pull: how long prefill keeps blocks for a decode that has not read
    kv_timeout_s: float = 30.0          # push: how long either side waits for the other (registration ttl)
    failure_policy: str = "recompute"   # decode side: recompute | fail when KV cannot be loaded
    bidirectional: bool = False         # keep finished turns' KV (decode) and read it back (prefill)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    faults: Faults = field(default_factory=Faults)       # tests only: kvhandoff serve --inject-faults

    def __post_init__(self):
        assert self.failure_policy in ("recompute", "fail"), self.failure_policy


def prompt_hash(prompt_token_ids: list[int]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(prompt_token_ids)}q", *prompt_token_ids), digest_size=16).hexdigest()


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# ---------------------------------------------------------------------------------------------
# Per-handoff state


@dataclass
class PushJob:
    """Prefill side of one push handoff: the computed prompt and the registration meet here."""
    handoff_id: str
    mode: str
    arrival: float = field(default_factory=time.monotonic)
    prompt_hash: str | None = None
    prefilled: RequestOutput | None = None
    prefilled_at: float | None = None
    registration: dict | None = None
    registered_at: float | None = None
    peer: str | None = None
    sent_tokens: int = 0                # layer-wise: tokens whose blocks went out with every layer
    current_chunk: int | None = None    # layer-wise: start of the chunk being sent layer by layer
    pending: list = field(default_factory=list)         # layer-wise handles in flight
    started: bool = False
    failed: str | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    on_finished: list[Callable[[], None]] = field(default_factory=list)

    def finish(self) -> None:
        """Mark the job over (written, failed or cancelled) and tell whoever waits, on any thread."""
        self.finished.set()
        for callback in self.on_finished:
            callback()
    phases: dict = field(default_factory=dict)
    bytes_sent: int = 0


@dataclass
class Incoming:
    """Decode side of one handoff: where its KV comes from and where it lands."""
    handoff_id: str
    mode: str
    num_kv_tokens: int
    peer: str | None = None
    remote_blocks: list[int] = field(default_factory=list)     # pull: known up front
    checksums: list[int] | None = None                         # pull: up front; push: with `done`
    skip_blocks: int = 0        # leading blocks this worker had already (its prefix cache): not transferred
    first_token: int | None = None                             # sampled by the prefill; arrives like checksums
    block_ids: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    reserved_at: float | None = None
    renewed_at: float | None = None
    transfer_s: float = 0.0
    ready_at: float | None = None
    deadline: float | None = None       # push: give up waiting for `done` after this
    settle_at: float | None = None      # push: set-aside blocks are safe to free after this
    bytes: int = 0
    failure: str | None = None

    @property
    def transferred_blocks(self) -> list[int]:
        """Our blocks the KV travels into (those after the ones we had already)."""
        return self.block_ids[self.skip_blocks:]


class Connector:
    def __init__(self, loop: EngineLoop, agent: TransferAgent, cfg: HandoffConfig, worker_name: str):
        self.loop, self.agent, self.cfg, self.worker_name = loop, agent, cfg, worker_name
        self.engine = loop.engine
        self.layout = KVLayout.of(self.engine.runner.kv_cache)
        self.kv = self.engine.runner.kv_cache
        self.leases = LeaseTable(cfg.lease_s)
        self.jobs: dict[str, PushJob] = {}              # prefill side, push
        self.incoming: dict[str, Incoming] = {}         # decode side
        # Handoffs that failed or that the router cancelled: id -> (reason, when). A request or a
        # registration that arrives for one later (a cancel can overtake a request still queued for
        # admission) is refused instead of pinning blocks nobody will ever collect.
        self.failed_handoffs: dict[str, tuple[str, float]] = {}
        self._peer_locks: dict[str, threading.Lock] = {}
        self.counters = {"handoffs": 0, "failures": 0, "lease_expiries": 0, "late_notifications": 0,
                         "verify_failures": 0, "bytes": 0}
        self._lock = threading.RLock()
        self._writer_q: queue.Queue = queue.Queue()
        self._reader_q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=fn, name=f"kvh-{fn.__name__}", daemon=True)
                         for fn in (self._writer, self._reader, self._notifications, self._housekeeper)]
        for t in self._threads:
            t.start()
        self.engine.runner.layer_hook = self._on_layer
        self.layer_group = max(1, -(-self.layout.num_layers // LAYER_WRITES_PER_CHUNK))
        self.retention = Retention(loop, cfg.retention, self.layout.block_bytes) if cfg.bidirectional else None
        self.cost_model = CostModel()

    def close(self) -> None:
        self._stop.set()
        self._writer_q.put(None)
        self._reader_q.put(None)

    # ---- peers ----------------------------------------------------------------------------------
    def ensure_peer(self, metadata_b64: str) -> str:
        """Connect to (and authenticate) the agent described by `metadata_b64`. Blocking: call it from
        an HTTP handler's executor, never from the engine thread. Concurrent first requests to one
        peer wait for a single handshake: a second add_peer would replace the connection and fail the
        transfers already posted on it."""
        metadata = base64.b64decode(metadata_b64)
        try:
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

    def _notify(self, peer: str | None, message: dict) -> None:
        if peer is None:
            return
        faults = self.cfg.faults
        if message.get("t") in faults.drop:
            log.warning("fault injection: %s notification for %s dropped", message.get("t"), message.get("id"))
            return
        if faults.delay_ms > 0 and not message.get("delayed"):
            log.warning("fault injection: %s notification delayed %.0f ms", message.get("t"), faults.delay_ms)
            threading.Timer(faults.delay_ms / 1000, self._notify, (peer, {**message, "delayed": True})).start()
            return
        try:
            self.agent.send_notification(peer, json.dumps(message).encode())
        except Exception as exc:        # the peer is gone: its own watchdog covers it
            log.info("notification %s to %s not sent: %s", message.get("t"), peer, exc)

    # ---- prefill side ---------------------------------------------------------------------------
    def submit_prefill(self, handoff_id: str, prompt_ids: list[int], params: SamplingParams, mode: str,
                       on_output: Callable[[RequestOutput], None],
                       preloaded: tuple[str, int] | None = None) -> PushJob | None:
        """Queue the prompt's prefill; `on_output` gets the final output (on the engine thread).
        Push modes return the job, whose `finished` event marks the end of the WRITE. `preloaded`:
        K/V read back from a decode worker (fetch_retained), as for LLMEngine.add_request."""
        assert mode in MODES
        self._refuse_if_ended(handoff_id)
        job = None
        if mode in PUSH_MODES:
            with self._lock:
                job = self.jobs.setdefault(handoff_id, PushJob(handoff_id, mode))
                job.mode, job.prompt_hash = mode, prompt_hash(prompt_ids)

        def on_final(out: RequestOutput) -> None:
            if not out.finished:
                return
            if out.finish_reason != "prefilled":
                self._prefill_failed(handoff_id, out.error or f"prefill ended: {out.finish_reason}")
                on_output(out)
                return
            computed = out.num_prompt_tokens - out.num_cached_tokens
            self.cost_model.observe_prefill(computed, (out.timings.get("prefill_ms") or 0) / 1e3)
            if mode in PULL_MODES:
                self.leases.pin(handoff_id, out.kv_block_ids)
                self.cfg.faults.reached("registered", handoff_id)
            else:
                self._prefilled(handoff_id, out)
            on_output(out)
        self.loop.submit(handoff_id, prompt_ids, params, on_final, prefill_only=True, preloaded=preloaded)
        return job

    def pull_params(self, handoff_id: str, out: RequestOutput, prompt_ids: list[int]) -> dict:
        """The handoff object a pull prefill answers with (checksums computed here, off the engine)."""
        return {"handoff_id": handoff_id, "prefill_worker": self.worker_name, "prompt_token_ids": prompt_ids,
                "num_kv_tokens": out.num_kv_tokens, "first_token_id": out.new_token_ids[0],
                "block_ids": out.kv_block_ids,
                "checksums": block_checksums(self.kv, out.kv_block_ids), "lease_ms": ms(self.cfg.lease_s),
                "agent_metadata": self.metadata_b64(),
                "phases_ms": {"prefill_queue": out.timings["queue_ms"], "prefill_compute": out.timings["prefill_ms"]}}

    def release_lease(self, handoff_id: str) -> bool:
        """Prefill side: the pinned KV of this handoff will not be read; unpin it (idempotent)."""
        lease = self.leases.release(handoff_id)
        if lease is None:
            return False
        self.loop.call(lambda: self.engine.release_pinned(handoff_id))
        return True

    def _prefill_failed(self, handoff_id: str, reason: str) -> None:
        with self._lock:
            self.failed_handoffs[handoff_id] = (reason, time.monotonic())
            job = self.jobs.pop(handoff_id, None)
        if job is not None:
            job.failed = reason
            if job.peer:
                self._notify(job.peer, {"t": "failed", "id": handoff_id, "reason": reason})
            job.finish()

    def prefill_refused(self, handoff_id: str, reason: str) -> None:
        """The prefill leg was refused before it started (busy, invalid): the push registration, if it
        came or comes, is answered with `failed` so the decode side frees its blocks now."""
        self._prefill_failed(handoff_id, f"the prefill worker refused the request: {reason}")

    def _prefilled(self, handoff_id: str, out: RequestOutput) -> None:
        with self._lock:
            job = self.jobs.get(handoff_id)
            if job is None:                 # cancelled meanwhile
                self.loop.call(lambda: self.engine.release_pinned(handoff_id))
                return
            job.prefilled, job.prefilled_at = out, time.monotonic()
            self._maybe_start(job)

    def register(self, registration: dict, peer: str) -> None:
        """A decode worker announces where a handoff's KV must go (either order with the prompt)."""
        handoff_id = registration["handoff_id"]
        with self._lock:
            failed = self.failed_handoffs.get(handoff_id)
            if failed is not None:
                self._notify(peer, {"t": "failed", "id": handoff_id, "reason": failed[0]})
                raise HandoffError(f"handoff {handoff_id} failed on the prefill side: {failed[0]}", 409)
            job = self.jobs.setdefault(handoff_id, PushJob(handoff_id, registration.get("mode", "push")))
            if job.registration is not None:
                raise HandoffError(f"handoff {handoff_id} is already registered", 409)
            skip = registration.setdefault("skip_blocks", 0)
            if not isinstance(skip, int) or not 0 <= skip < len(registration["block_ids"]):
                raise HandoffError(f"skip_blocks must be a block index below the registered blocks, not {skip!r}", 400)
            job.registration, job.registered_at, job.peer = registration, time.monotonic(), peer
            self.cfg.faults.reached("registered", handoff_id)
            self._maybe_start(job)

    def _maybe_start(self, job: PushJob) -> None:
        if job.prefilled is not None and job.registration is not None and not job.started:
            job.started = True
            self._writer_q.put(job)

    def _on_layer(self, layer: int, chunks) -> None:
        """Engine thread, push-layerwise: queue the layers computed since the last write of every
        registered prefill chunk, one write per group of `layer_group` layers (a group of a block's
        layers is one contiguous range, so a group costs no more descriptors than a layer, and the
        per-write overhead, paid on the prefill's own core, is not paid per layer). A chunk goes out
        this way only if it started at layer 0 with every earlier token already sent; otherwise the
        final WRITE covers it (whole blocks)."""
        last_layer = self.layout.num_layers - 1
        if (layer + 1) % self.layer_group and layer != last_layer:
            return
        first_layer = layer - layer % self.layer_group
        for chunk in chunks:
            request = chunk.request
            job = self.jobs.get(request.request_id) if request.prefill_only else None
            if job is None or job.mode != "push-layerwise" or job.registration is None or job.started:
                continue
            start, end = request.num_computed_tokens, request.num_computed_tokens + chunk.num_new_tokens
            if layer == 0 and start == job.sent_tokens:
                job.current_chunk = start
            if job.current_chunk != start:
                continue
            local, remote = self._blocks_of(job, start, end, request.block_table)
            self._writer_q.put((job, first_layer, layer - first_layer + 1, local, remote))
            if layer == last_layer:
                job.sent_tokens, job.current_chunk = end, None

    def _writer(self) -> None:
        while (item := self._writer_q.get()) is not None:
            try:
                if isinstance(item, tuple):
                    self._write_layer(*item)
                else:
                    self._write_job(item)
            except Exception:
                log.exception("writer failed")

    def _blocks_of(self, job: PushJob, start: int, end: int, local: list[int]) -> tuple[list[int], list[int]]:
        """The blocks holding tokens [start, end), less those the decode side has already (skip_blocks)."""
        bs = self.engine.block_size
        first, last = max(start // bs, job.registration["skip_blocks"]), -(-end // bs)
        return local[first:last], job.registration["block_ids"][first:last]

    def _write_layer(self, job: PushJob, first_layer: int, num_layers: int, local: list[int],
                     remote: list[int]) -> None:
        if job.failed is None and local:
            self.cfg.faults.slow_down()
            job.pending.append(self.agent.write(job.peer, self.layout.layer_descs(local, first_layer, num_layers),
                                                self.layout.layer_descs(remote, first_layer, num_layers)))
            self.cfg.faults.reached("transfer", job.handoff_id)

    def _write_job(self, job: PushJob) -> None:
        """Everything the layer-wise writes did not cover, then `done` with the checksums."""
        out, reg, handoff_id = job.prefilled, job.registration, job.handoff_id
        started = time.monotonic()
        job.phases["handoff_wait"] = ms(started - job.prefilled_at)    # computed prompt waiting for its destination
        try:
            if started > job.registered_at + reg["ttl_ms"] / 1000:
                raise HandoffError("the registration expired before the prompt was computed")
            if reg["prompt_hash"] != job.prompt_hash:
                raise HandoffError("the decode worker registered a different prompt (tokenizers disagree?)")
            if reg["num_kv_tokens"] != out.num_kv_tokens or len(reg["block_ids"]) != len(out.kv_block_ids):
                raise HandoffError(f"registration does not match the prompt: {reg['num_kv_tokens']} vs "
                                   f"{out.num_kv_tokens} tokens")
            for handle in job.pending:
                handle.wait(self.cfg.kv_timeout_s)
                job.bytes_sent += handle.nbytes
            skip = reg["skip_blocks"]
            rest = slice(max(job.sent_tokens // self.engine.block_size, skip), None)
            local, remote = out.kv_block_ids[rest], reg["block_ids"][rest]
            checksums = block_checksums(self.kv, out.kv_block_ids[skip:])    # of what the decode side gets
            done = json.dumps({"t": "done", "id": handoff_id, "checksums": checksums,
                               "first_token": out.new_token_ids[0]}).encode()
            if self.cfg.faults.write_fail:
                raise TransferError("injected WRITE failure (--inject-faults write_fail)")
            if "done" in self.cfg.faults.drop:
                log.warning("fault injection: done notification for %s dropped", handoff_id)
                done = b""
            if local:
                self.cfg.faults.slow_down()
                handle = self.agent.write(job.peer, self.layout.block_descs(local), self.layout.block_descs(remote),
                                          notify=done)
                self.cfg.faults.reached("transfer", handoff_id)
                job.bytes_sent += handle.wait(self.cfg.kv_timeout_s).nbytes
            elif done:
                self.agent.send_notification(job.peer, done)
        except (TransferError, HandoffError, OSError) as exc:
            job.failed = f"KV write to {reg.get('decode_worker', job.peer)} failed: {exc}"
            self.counters["failures"] += 1
            self._notify(job.peer, {"t": "failed", "id": handoff_id, "reason": job.failed})
        finally:
            job.phases["transfer"] = ms(time.monotonic() - started)
            with self._lock:
                self.jobs.pop(handoff_id, None)
            self.loop.call(lambda: self.engine.release_pinned(handoff_id))
            if not job.failed:
                self.counters["handoffs"] += 1
                self.counters["bytes"] += job.bytes_sent
            job.finish()

    def _refuse_if_ended(self, handoff_id: str) -> None:
        with self._lock:
            ended = self.failed_handoffs.get(handoff_id)
        if ended is not None:
            raise HandoffError(f"handoff {handoff_id} already ended: {ended[0]}", 409)

    def cancel(self, handoff_id: str) -> None:
        """Either side: the router gave up on this handoff (client gone, other leg refused): free
        whatever it holds, and refuse its request should that still arrive."""
        self.release_lease(handoff_id)
        with self._lock:
            self.failed_handoffs.setdefault(handoff_id, ("cancelled", time.monotonic()))
            job = self.jobs.get(handoff_id)
            if job is not None and not job.started:
                self.jobs.pop(handoff_id)
                if job.prefilled is not None:
                    self.loop.call(lambda: self.engine.release_pinned(handoff_id))
                job.failed = "cancelled"
                job.finish()
        self.loop.abort(handoff_id)

    # ---- decode side ----------------------------------------------------------------------------
    def submit_decode(self, handoff_id: str, mode: str, prompt_ids: list[int], params: SamplingParams,
                      on_output: Callable[[RequestOutput], None], remote: dict | None = None,
                      peer: str | None = None, register: Callable[[Incoming], None] | None = None,
                      retain: bool = False, supersedes: str | None = None) -> Incoming:
        """Queue a request whose KV comes from a prefill worker. Pull: `remote` is the prefill's
        handoff object and `peer` its agent. Push: `register(incoming)` is called (engine thread) once
        blocks are reserved and must deliver the registration to the prefill worker. `retain`
        (bidirectional): keep the finished turn's KV, replacing the conversation's turn `supersedes`."""
        self._refuse_if_ended(handoff_id)
        retain = retain and self.retention is not None
        num_kv = len(prompt_ids)            # the whole prompt; the prefill also sampled the first token
        incoming = Incoming(handoff_id, mode, num_kv, peer=peer)
        if remote is not None:
            if remote["num_kv_tokens"] != num_kv or remote["prompt_token_ids"] != prompt_ids:
                raise HandoffError("the handoff object does not match the prompt", 400)
            incoming.remote_blocks, incoming.checksums = list(remote["block_ids"]), list(remote["checksums"])
            incoming.first_token = remote.get("first_token_id")
            if not self._is_token(incoming.first_token):
                raise HandoffError("the handoff object lacks a valid first_token_id", 400)
        with self._lock:
            self.incoming[handoff_id] = incoming

        def on_reserved(block_ids: list[int], num_local_tokens: int) -> None:       # engine thread
            incoming.block_ids, incoming.reserved_at = block_ids, time.monotonic()
            incoming.skip_blocks = num_local_tokens // self.engine.block_size
            if remote is not None:      # from here on, remote blocks and checksums name only what travels
                incoming.remote_blocks = incoming.remote_blocks[incoming.skip_blocks:]
                incoming.checksums = incoming.checksums[incoming.skip_blocks:]
            if mode in PULL_MODES:
                self.cfg.faults.reached("registered", handoff_id)
            if mode == "pull":
                self._reader_q.put((incoming, self._post_read(incoming)))
            elif mode == "pull-reader":
                self._reader_q.put((incoming, None))
            else:
                incoming.deadline = time.monotonic() + self.cfg.kv_timeout_s
                incoming.settle_at = time.monotonic() + 2 * self.cfg.kv_timeout_s
                register(incoming)

        def on_out(out: RequestOutput) -> None:        # engine thread
            if out.num_output_tokens >= KILL_AFTER_TOKENS:
                self.cfg.faults.reached("decode", handoff_id, delay_s=KILL_DELAY_S)
            if out.finished:
                out.handoff = self._decode_report(incoming, out)
                if out.retained is not None:        # (a failed turn keeps the previous one in place)
                    out.handoff["retained"] = self.retention.on_retained(out.retained, supersedes)
            on_output(out)
        self.loop.submit_remote(handoff_id, prompt_ids, params, num_kv, on_out, on_reserved, retain=retain)
        return incoming

    # ---- bidirectional: reading a conversation's KV back from the decode worker that kept it ----
    def fetch_retained(self, handoff_id: str, peer: str, lease: dict, num_blocks: int) -> tuple[str, int]:
        """Prefill side, blocking (an executor thread): READ the first `num_blocks` retained blocks
        named by a decode worker's read `lease` into blocks pinned here, verify them, and tell the
        decode worker the read is over. Returns (pin id, bytes read) for submit_prefill(preloaded=...);
        raises HandoffError (nothing left pinned) if any step fails."""
        remote, checksums = list(lease["block_ids"])[:num_blocks], list(lease["checksums"])[:num_blocks]
        if len(remote) != num_blocks or len(checksums) != num_blocks:
            raise HandoffError(f"the read lease covers {len(remote)} blocks, not {num_blocks}", 502)
        pin_id = f"reuse:{handoff_id}"
        try:
            local = self.loop.call(lambda: self.engine.allocate_pinned(pin_id, num_blocks)).result(self.cfg.kv_timeout_s)
            if local is None:
                raise HandoffError("no free blocks to read the retained KV into", 503)
            try:
                handle = self.agent.read(peer, self.layout.block_descs(local), self.layout.block_descs(remote))
                handle.wait(self.cfg.kv_timeout_s)
                bad = sum(a != b for a, b in zip(block_checksums(self.kv, local), checksums))
                if bad:
                    self.counters["verify_failures"] += 1
                    raise HandoffError(f"retained KV failed verification ({bad} of {num_blocks} blocks differ)", 502)
            except BaseException:
                self.loop.call(lambda: self.engine.release_pinned(pin_id))
                raise
        except (TransferError, OSError, TimeoutError, ValueError, TypeError, AssertionError) as exc:
            # (the last three: a lease naming blocks or checksums that make no sense here)
            raise HandoffError(f"reverse read from {peer} failed: {exc!r}", 502) from None
        finally:
            self._notify(peer, {"t": "unlease", "id": lease["lease_id"]})
        return pin_id, handle.nbytes

    def lease_retained(self, retention_id: str, num_blocks: int) -> dict | None:
        """Decode side, blocking (an executor thread): hold a retained entry for a reverse read and
        say where its blocks are, with their checksums; None if it is gone."""
        if self.retention is None:
            return None
        lease = self.loop.call(lambda: self.retention.lease(retention_id, num_blocks)).result(self.cfg.kv_timeout_s)
        if lease is not None:
            # Safe off the engine thread: a leased entry's blocks are neither freed nor written.
            lease["checksums"] = block_checksums(self.kv, lease["block_ids"])
            lease["agent_metadata"] = self.metadata_b64()
        return lease

    def release_retained(self, retention_id: str) -> bool:
        if self.retention is None:
            return False
        return bool(self.loop.call(lambda: self.retention.release(retention_id)).result(self.cfg.kv_timeout_s))

    def registration(self, incoming: Incoming, mode: str, prompt_ids: list[int]) -> dict:
        return {"handoff_id": incoming.handoff_id, "mode": mode, "decode_worker": self.worker_name,
                "agent_metadata": self.metadata_b64(), "block_ids": incoming.block_ids,
                "num_kv_tokens": incoming.num_kv_tokens, "skip_blocks": incoming.skip_blocks,
                "prompt_hash": prompt_hash(prompt_ids),
                "ttl_ms": ms(self.cfg.kv_timeout_s)}

    def _post_read(self, incoming: Incoming):
        incoming.transfer_s = time.monotonic()
        return self.agent.read(incoming.peer, self.layout.block_descs(incoming.transferred_blocks),
                               self.layout.block_descs(incoming.remote_blocks))

    def _reader(self) -> None:
        while (item := self._reader_q.get()) is not None:
            incoming, handle = item
            try:
                if handle is None:
                    handle = self._post_read(incoming)
                self.cfg.faults.reached("transfer", incoming.handoff_id)
                self.cfg.faults.slow_down()         # the bytes arrive late, as over a slow link
                if self.cfg.faults.read_fail:
                    raise TransferError("injected READ failure (--inject-faults read_fail)")
                handle.wait(self.cfg.kv_timeout_s)
                incoming.bytes = handle.nbytes
                incoming.transfer_s = time.monotonic() - incoming.transfer_s
                self._arrived(incoming)
            except Exception as exc:
                self._load_failed(incoming, f"KV read from {incoming.peer} failed: {exc}", settled=True)
            finally:
                self._notify(incoming.peer, {"t": "release", "id": incoming.handoff_id})

    def _arrived(self, incoming: Incoming) -> None:
        """The bytes are in our blocks: verify them, then let the engine decode."""
        if not self._is_token(incoming.first_token):
            self._load_failed(incoming, f"the prefill sent no valid first token ({incoming.first_token!r})", settled=True)
            return
        started = time.monotonic()
        got = block_checksums(self.kv, incoming.transferred_blocks)
        if incoming.mode in PULL_MODES:     # push: decode sees no transfer, only this verification
            incoming.transfer_s += time.monotonic() - started
        if got != incoming.checksums:
            self.counters["verify_failures"] += 1
            bad = sum(a != b for a, b in zip(got, incoming.checksums or []))
            self._load_failed(incoming, f"KV failed verification ({bad} of {len(got)} blocks differ; "
                                        f"the lease may have expired)", settled=True)
            return
        with self._lock:
            self.incoming.pop(incoming.handoff_id, None)
        incoming.ready_at = time.monotonic()
        self.counters["handoffs"] += 1
        self.counters["bytes"] += incoming.bytes
        self.loop.call(lambda: self.engine.kv_ready(incoming.handoff_id, incoming.num_kv_tokens, incoming.first_token))

    def _is_token(self, token) -> bool:
        return isinstance(token, int) and 0 <= token < self.engine.model_config.vocab_size

    def fail_incoming(self, handoff_id: str, reason: str, settled: bool = True, recompute: bool | None = None) -> bool:
        """Decode side: the KV of this handoff will not come (told by the router or the HTTP layer);
        recompute or fail by policy (or as `recompute` says). `settled=False` when a transfer into its
        blocks may still be under way: they stay aside until the push deadline. False if the handoff
        was not waiting for KV."""
        incoming = self.incoming.get(handoff_id)
        if incoming is None:
            return False
        self._load_failed(incoming, reason, settled=settled, recompute=recompute)
        return True

    def _load_failed(self, incoming: Incoming, reason: str, settled: bool, recompute: bool | None = None) -> None:
        with self._lock:
            if self.incoming.pop(incoming.handoff_id, None) is None:
                return          # already settled (arrived, or failed once): a late report changes nothing
        incoming.failure = reason
        self.counters["failures"] += 1
        if recompute is None:
            recompute = self.cfg.failure_policy == "recompute"
        log.warning("handoff %s: %s (%s)", incoming.handoff_id, reason, "recompute" if recompute else "fail")
        self.loop.kv_failed(incoming.handoff_id, recompute, reason, settled=settled)
        if not settled:
            with self._lock:
                self.incoming[f"settle:{incoming.handoff_id}"] = incoming

    def _decode_report(self, incoming: Incoming, out: RequestOutput) -> dict:
        t = out.timings or {}
        report = {"handoff_id": incoming.handoff_id, "mode": incoming.mode, "decode_worker": self.worker_name,
                  "bytes_transferred": incoming.bytes, "blocks": len(incoming.transferred_blocks),
                  "decode_cached_tokens": incoming.skip_blocks * self.engine.block_size, "kv_source": "remote" if incoming.failure is None else "recomputed",
                  "phases_ms": {}}
        phases = report["phases_ms"]
        if incoming.reserved_at is not None:
            phases["handoff_wait"] = ms(incoming.reserved_at - incoming.arrival)
        if incoming.mode in PULL_MODES and incoming.failure is None:
            phases["transfer"] = ms(incoming.transfer_s)
        if incoming.ready_at is not None:
            phases["decode_queue"] = t.get("decode_queue_ms")
            # The first token came with the KV; the decode's first step makes the second one.
            phases["first_step"] = t.get("first_step_ms")
        if incoming.failure:
            report["error"] = incoming.failure
        return report

    # ---- notifications and housekeeping ---------------------------------------------------------
    def _notifications(self) -> None:
        while not self._stop.is_set():
            note = self.agent.wait_notification(timeout=0.5)
            if note is None:
                continue
            peer, raw = note
            try:
                msg = json.loads(raw)
                kind, handoff_id = msg["t"], msg["id"]
            except (ValueError, KeyError, TypeError):
                log.warning("malformed notification from %s dropped", peer)
                continue
            try:
                self._on_notification(peer, kind, handoff_id, msg)
            except Exception:
                log.exception("notification %s for %s failed", kind, handoff_id)

    def _on_notification(self, peer: str, kind: str, handoff_id: str, msg: dict) -> None:
        if kind == "release":
            if not self.release_lease(handoff_id):
                self.counters["late_notifications"] += 1
        elif kind == "renew":
            if not self.leases.renew(handoff_id):
                self.counters["late_notifications"] += 1
        elif kind == "cancel":
            self.cancel(handoff_id)
        elif kind == "unlease":
            if self.retention is not None:
                self.loop.call(lambda: self.retention.unlease(handoff_id))
        elif kind in ("done", "failed"):
            with self._lock:
                incoming = self.incoming.get(handoff_id) or self.incoming.get(f"settle:{handoff_id}")
            if incoming is None:
                self.counters["late_notifications"] += 1
                return
            if incoming.failure is not None:        # we had given up: the blocks can go back now
                with self._lock:
                    self.incoming.pop(f"settle:{handoff_id}", None)
                self.loop.call(lambda: self.engine.settle(handoff_id))
            elif kind == "done":
                incoming.checksums, incoming.first_token = msg.get("checksums"), msg.get("first_token")
                incoming.bytes = incoming.bytes or len(incoming.transferred_blocks) * self.layout.block_bytes
                self._arrived(incoming)
            else:
                self._load_failed(incoming, f"prefill worker reported: {msg.get('reason', 'failure')}", settled=True)

    def _housekeeper(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._housekeep()
            except Exception:
                log.exception("handoff housekeeping failed")

    def _housekeep(self) -> None:
        now = time.monotonic()
        if self.retention is not None:
            self.retention.expire(now)
        for lease in self.leases.expire(now):
            self.counters["lease_expiries"] += 1
            log.warning("handoff %s: lease expired, blocks freed", lease.handoff_id)
            self.loop.call(lambda hid=lease.handoff_id: self.engine.release_pinned(hid))
        live_peers = set(self.agent.peers)
        with self._lock:
            items = list(self.incoming.items())
            stale = [hid for hid, (_, when) in self.failed_handoffs.items() if now - when > 4 * self.cfg.kv_timeout_s]
            for hid in stale:
                del self.failed_handoffs[hid]
            expired_jobs = [j for j in self.jobs.values() if not j.started and
                            now - j.arrival > 2 * self.cfg.kv_timeout_s]
        for key, incoming in items:
            if key.startswith("settle:"):
                if now >= (incoming.settle_at or 0) or incoming.peer not in live_peers:
                    with self._lock:
                        self.incoming.pop(key, None)
                    self.loop.call(lambda hid=incoming.handoff_id: self.engine.settle(hid))
            elif incoming.peer is not None and incoming.peer not in live_peers:
                self._load_failed(incoming, f"prefill worker's agent {incoming.peer!r} is gone", settled=True)
            elif incoming.deadline is not None and now > incoming.deadline:
                self._notify(incoming.peer, {"t": "cancel", "id": incoming.handoff_id})
                self._load_failed(incoming, f"no KV from the prefill worker within {self.cfg.kv_timeout_s:.0f}s",
                                  settled=False)
            elif incoming.reserved_at is None and now - incoming.arrival > 1.0 and \
                    not self.loop.knows(incoming.handoff_id):
                # Aborted before any block was reserved: no transfer can start, just let prefill go.
                with self._lock:
                    self.incoming.pop(key, None)
                self._notify(incoming.peer, {"t": "release" if incoming.mode in PULL_MODES else "cancel",
                                             "id": incoming.handoff_id})
            elif incoming.mode in PULL_MODES and incoming.reserved_at is None and \
                    now - (incoming.renewed_at or incoming.arrival) > self.cfg.lease_s / 3:
                incoming.renewed_at = now       # still queued for blocks: keep prefill's lease alive
                self._notify(incoming.peer, {"t": "renew", "id": incoming.handoff_id})
        for job in expired_jobs:        # a prompt whose registration never came, or the reverse
            log.warning("handoff %s: no %s within %.0fs, dropped", job.handoff_id,
                        "registration" if job.registration is None else "prompt", 2 * self.cfg.kv_timeout_s)
            self._prefill_failed(job.handoff_id, "the other side of the handoff never arrived")
            if job.prefilled is not None:
                self.loop.call(lambda hid=job.handoff_id: self.engine.release_pinned(hid))
