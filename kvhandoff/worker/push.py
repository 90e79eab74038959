"""Push (docs/HANDOFF.md, "Push and push-layerwise"), top to bottom; layerwise.py extends it.

The router picks the decode worker at arrival (early binding) and sends both legs at once. The
decode worker reserves the destination blocks and registers them with the prefill worker
(messages.Registration, POST /kv/register); the prefill's writer thread matches registration and
computed prompt, in either order, WRITEs the blocks and sends Done (riding on the last WRITE) with
the checksums and the first token; decode verifies and decodes. Push moves the same bytes as pull:
it reorders the dependencies, so that preparing the destination overlaps the prompt's computation.

The timing rule (why set-aside blocks can be freed without hearing from a silent peer): the
registration carries `ttl_ms`; prefill starts no WRITE later than one ttl after it last heard from
decode (the registration, or a Renew), and decode, once it gives up, keeps the blocks aside until two
ttls after it last spoke (the registration, or a Renew it sent). A transfer into them can only happen
in between. Keep-alive: a prompt can take longer to compute than the ttl (a long prompt on a slow
CPU), so while the engine computes a registered prompt, prefill sends Progress at most every ttl / 3,
each time more of it was computed; a decode worker still waiting moves its deadline and answers Renew.
Only progress counts, not a prompt merely queued: two full pools (prefill's pinned with prompts
waiting for registrations, decode's reserved for prompts prefill has no room to compute) are a
deadlock that the ttl breaks, and a keep-alive for queued prompts would keep it forever.

Late binding (router --late-binding): while the prompt is still being computed, the router may move
the handoff to another decode worker (POST /kv/rebind with the next `binding` number). Under the
job's lock, and only while no WRITE has started (push-layerwise: no layer computed for it yet), the
registration is withdrawn and the decode worker that made it is told (Withdrawn: no WRITE will land
in its blocks, so it frees them at once); from then on only a registration of the new binding is
taken, and a Cancel from the decode worker moved away from no longer speaks for the handoff.

Failure edges (each end is told at once where the other side knows):
- the WRITE fails: prefill sends Failed, decode recomputes (or fails, by policy).
- the prompt fails or is refused on prefill: Failed to a registered decode worker; one that registers
  later is refused (409) and told Failed; the router also reports it (/kv/failed).
- a registration or a prompt whose other half never comes: dropped after 2 x --kv-timeout-s.
- no Done within the deadline (prefill silent, or Done lost): decode sends Cancel, recomputes, and
  keeps the blocks aside until the timing rule says no WRITE can land.
- either worker dies: the other's agent sees the connection die; decode recomputes at once.
- the decode request ends first (client gone): Cancel to prefill; blocks aside until prefill
  answers Failed, which it sends once no WRITE can land (after the layer WRITEs already posted).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvhandoff.engine.request import RequestOutput, SamplingParams
from kvhandoff.transfer.errors import TransferError, TransferTimeout
from kvhandoff.wire import messages as M
from kvhandoff.worker.reuse import FetchingPrefill, ReusePrefill
from kvhandoff.worker.runtime import DecodeSide, HandoffError, Incoming, Runtime, ms, prompt_hash

MOVED = "handoff_moved"     # the error code of a registration refused because the handoff moved on
log = logging.getLogger("kvhandoff.handoff")


# ---------------------------------------------------------------------------------------------------
# Prefill side

CANCELLED = "cancelled"      # a PushJob's end when the router or the decode side gave up


@dataclass
class PushJob:
    """Prefill side of one push handoff: the computed prompt and the registration meet here."""
    handoff_id: str
    arrival: float = field(default_factory=time.monotonic)
    prompt_hash: str | None = None          # set when the prompt arrives
    prefilled: RequestOutput | None = None  # set when it is computed (its blocks pinned)
    prefilled_at: float | None = None
    registration: M.Registration | None = None
    peer: str | None = None
    binding: int = 0                        # late binding: the destination registrations must name (Rebind)
    renewed_at: float = 0.0                 # decode's last word (registration or Renew): the WRITE's clock
    progress_at: float = 0.0                # our last Progress
    progress_tokens: int = 0                # how much of the prompt was computed at that Progress
    started: bool = False                   # handed to the writer: from here on the writer ends it
    queued_at: float | None = None
    failed: str | None = None
    phases: dict = field(default_factory=dict)
    bytes_sent: int = 0
    fetch: Incoming | None = None           # bidirectional: history read back before computing
    # push-layerwise (layerwise.py): what left while the prompt was being computed
    layerwise: bool = False
    chunk_start: int | None = None          # the chunk being sent layer by layer
    layers_sent: int = 0                    # ... how many of its layers
    group: int = 1                          # ... how many layers a WRITE of it carries
    blocks_sent: int = 0                    # leading blocks whose every layer has been queued
    pending: list = field(default_factory=list)     # their WRITE handles
    committed: bool = False                 # a layer-wise WRITE went to the registration: no rebinding
    prefilled_perf: float = 0.0             # when the prompt was computed (perf_counter, as handles)
    bytes_before_prefill_end: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: threading.Event = field(default_factory=threading.Event)
    waiters: list = field(default_factory=list)     # callbacks for the end (written, failed, cancelled)

    @property
    def ttl_s(self) -> float:
        return self.registration.ttl_ms / 1000

    def finish(self) -> None:
        self.finished.set()
        for callback in self.waiters:
            callback()


class PushPrefill(FetchingPrefill):
    def __init__(self, rt: Runtime, reuse: ReusePrefill):
        super().__init__(rt, reuse)
        rt.on(M.Renew, PushJob, self._renewed)
        rt.on(M.Cancel, PushJob, self._decode_cancelled)
        rt.on_peer_lost(self._peer_lost)
        rt.every_tick(self._housekeep)

    async def prefill(self, kv: M.PushPrefillParams, prompt_ids: list[int], params: SamplingParams,
                      on_first: Callable[[RequestOutput], None]) -> dict:
        """Compute the prompt (its first token goes to `on_first` at once), wait for its WRITE (or its
        failure), answer (the router's prefill leg)."""
        job = self.rt.table.get_or_add(kv.handoff_id, lambda: PushJob(kv.handoff_id))
        job.prompt_hash, job.layerwise = prompt_hash(prompt_ids), kv.mode.layerwise
        out, reuse_report = await self.compute(job, kv, prompt_ids, params)
        on_first(out)
        await self._wait(job)
        if job.failed:
            raise HandoffError(job.failed, 502)
        return M.PushPrefillAnswer(
            handoff_id=kv.handoff_id, prefill_worker=self.rt.worker_name, num_kv_tokens=out.num_kv_tokens,
            blocks=len(out.kv_block_ids or []), bytes_transferred=job.bytes_sent, **self.extra_answer(job),
            phases_ms={"prefill_queue": out.timings["queue_ms"], "prefill_compute": out.timings["prefill_ms"],
                       **job.phases}, **reuse_report).to_dict()

    def extra_answer(self, job: PushJob) -> dict:
        return {}

    async def _wait(self, job: PushJob) -> None:
        """Wait for the job's end without holding a thread (with one per waiting prefill, a burst
        of push requests once took every thread, and the registrations they waited for starved)."""
        aio, ended = asyncio.get_running_loop(), asyncio.Event()
        job.waiters.append(lambda: aio.call_soon_threadsafe(ended.set))
        if not job.finished.is_set():
            try:
                await asyncio.wait_for(ended.wait(), 4 * self.rt.cfg.kv_timeout_s)
            except TimeoutError:
                raise HandoffError(f"the KV write of handoff {job.handoff_id} did not end within "
                                   f"{4 * self.rt.cfg.kv_timeout_s:.0f} s", 504) from None

    def refused(self, handoff_id: str, reason: str) -> None:
        """The prefill leg was refused before it started (busy, invalid): a registered decode worker
        hears it at once, and one that registers later is refused."""
        job = self.rt.table.get(handoff_id)
        if isinstance(job, PushJob):
            self._end(job, f"the prefill worker refused the request: {reason}")
        else:
            self.rt.table.end(handoff_id, f"the prefill worker refused the request: {reason}")

    def finished(self, job: PushJob, request, out: RequestOutput) -> bool:
        """Engine thread: the prompt is computed (keep its blocks pinned for the WRITE) or failed."""
        self.reuse.finished(job.fetch)
        if out.finish_reason != "prefilled":
            self._end(job, out.error or f"prefill ended: {out.finish_reason}")
            return False
        # Set first, then look (as pull's finished): whoever ended the job before this saw nothing
        # prefilled, so the blocks go back here; whoever ends it after sees them and releases them.
        with job.lock:
            job.prefilled, job.prefilled_at = out, time.monotonic()
        if self.rt.table.get(job.handoff_id) is not job:
            return False                        # ended meanwhile: nobody will write these blocks
        self.observe(out)
        self._keep_alive(job, job.prefilled_at, out.num_kv_tokens)
        self._maybe_start(job)
        return True

    def register(self, registration: M.Registration, peer: str) -> None:
        """A decode worker announces where the handoff's KV must go (either order with the prompt)."""
        handoff_id = registration.handoff_id
        try:
            job = self.rt.table.get_or_add(handoff_id, lambda: PushJob(handoff_id))
        except HandoffError:
            self.rt.notify(peer, M.Failed(handoff_id=handoff_id, reason=self.rt.table.ended(handoff_id) or "ended"))
            raise
        if not registration.ttl_ms > 0:
            raise HandoffError(f"ttl_ms must be a positive number of milliseconds, not {registration.ttl_ms!r}", 400)
        if not 0 <= registration.skip_blocks < len(registration.block_ids):
            raise HandoffError(f"skip_blocks must be a block index below the registered blocks, not "
                               f"{registration.skip_blocks!r}", 400)
        self.rt.peer_layout(registration.pool_blocks, registration.block_ids, "the registration")
        with job.lock:
            moved = registration.binding != job.binding
            if not moved and job.registration is not None:
                raise HandoffError(f"handoff {handoff_id} is already registered", 409)
            if not moved:
                job.registration, job.peer, job.layerwise = registration, peer, registration.mode.layerwise
                job.renewed_at = job.progress_at = time.monotonic()
        if moved:               # it may hold blocks for us already: they will get nothing
            self.rt.notify(peer, M.Withdrawn(handoff_id=handoff_id))
            raise HandoffError(f"handoff {handoff_id} was moved to another decode worker (binding "
                               f"{job.binding}, not {registration.binding})", 409, code=MOVED)
        self.rt.cfg.faults.reached("registered", handoff_id)
        self._maybe_start(job)

    def rebind(self, rebind: M.Rebind) -> None:
        """Late binding: the router moves the handoff to another decode worker, whose registration
        will carry `rebind.binding`. 409 once a WRITE has started (the KV goes where it goes)."""
        job = self.rt.table.get_or_add(rebind.handoff_id, lambda: PushJob(rebind.handoff_id))
        with job.lock:
            if job.started or job.committed:
                raise HandoffError(f"handoff {job.handoff_id}: the KV write to "
                                   f"{job.registration.decode_worker} has started", 409)
            if rebind.binding <= job.binding:
                raise HandoffError(f"handoff {job.handoff_id} is at binding {job.binding} already", 409)
            job.binding, withdrawn = rebind.binding, job.peer
            job.registration = job.peer = None
            job.arrival = time.monotonic()       # the new registration gets the full wait (housekeeping)
        self.rt.notify(withdrawn, M.Withdrawn(handoff_id=job.handoff_id))

    def _maybe_start(self, job: PushJob) -> None:
        with job.lock:
            if job.prefilled is None or job.registration is None or job.started or \
                    self.rt.table.get(job.handoff_id) is not job:
                return
            job.started, job.queued_at = True, time.monotonic()
        self.rt.writer.put(lambda: self._write(job), self.rt.cfg.faults.due())

    def _write(self, job: PushJob) -> None:
        """Writer thread: everything the layer-wise writes did not cover, then Done with the checksums."""
        out, reg, handoff_id, faults = job.prefilled, job.registration, job.handoff_id, self.rt.cfg.faults
        started = time.monotonic()
        # The computed prompt waited for its destination until queued_at; from then on it is the
        # transfer's time, the writer's queue and a slow link's delay included.
        job.phases["handoff_wait"] = ms(job.queued_at - job.prefilled_at)
        try:
            if started > job.renewed_at + job.ttl_s:
                raise HandoffError("the registration expired before the prompt was computed")
            if reg.prompt_hash != job.prompt_hash:
                raise HandoffError("the decode worker registered a different prompt (tokenizers disagree?)")
            if reg.num_kv_tokens != out.num_kv_tokens or len(reg.block_ids) != len(out.kv_block_ids):
                raise HandoffError(f"registration does not match the prompt: {reg.num_kv_tokens} vs "
                                   f"{out.num_kv_tokens} tokens")
            self.before_final_write(job)
            rest = slice(self.first_unsent_block(job), None)
            local, remote = out.kv_block_ids[rest], reg.block_ids[rest]
            checksums = self.rt.checksums(out.kv_block_ids[reg.skip_blocks:])    # of what decode gets
            done = M.encode(M.Done(handoff_id=handoff_id, checksums=checksums, first_token=out.new_token_ids[0]))
            if faults.write_fail:
                raise TransferError("injected WRITE failure (--inject-faults write_fail)")
            if "done" in faults.drop:
                log.warning("fault injection: done notification for %s dropped", handoff_id)
                done = b""
            if local:
                handle = self.rt.agent.write(job.peer, self.rt.layout.block_descs(local),
                                             self.rt.layout.peer(reg.pool_blocks).block_descs(remote), notify=done)
                faults.reached("transfer", handoff_id)
                job.bytes_sent += handle.wait(self.rt.cfg.kv_timeout_s).nbytes
            elif done:
                self.rt.agent.send_notification(job.peer, done)
        except (TransferError, HandoffError, OSError) as exc:
            job.failed = f"KV write to {reg.decode_worker} failed: {exc}"
            self.rt.counters.bump("failures")
            self.rt.notify(job.peer, M.Failed(handoff_id=handoff_id, reason=job.failed))
        finally:
            job.phases["transfer"] = ms(time.monotonic() - job.queued_at)
            self.rt.table.claim(handoff_id, job.failed or "written", job)
            self.rt.release(handoff_id)
            if not job.failed:
                self.rt.counters.bump("handoffs")
                self.rt.counters.bump("bytes", job.bytes_sent)
            job.finish()

    # Layer-wise push (layerwise.py) sends most of the KV before this point.
    def before_final_write(self, job: PushJob) -> None:
        pass

    def first_unsent_block(self, job: PushJob) -> int:
        return job.registration.skip_blocks

    def cancel(self, job: PushJob) -> None:
        """The router or the decode side gave up. A job the writer has started ends with its WRITE
        (the blocks it reads from must stay pinned until then). A registered decode worker hears
        that nothing (more) will be written, so it frees the blocks it set aside at once instead of
        at its settle time (2 x --kv-timeout-s)."""
        with job.lock:          # (one lock with _maybe_start: a job is either started or claimed here)
            if job.started or self.rt.table.claim(job.handoff_id, CANCELLED, job) is None:
                return
        job.failed = CANCELLED
        self._tell_decode(job, M.Failed(handoff_id=job.handoff_id, reason=CANCELLED))
        if job.prefilled is not None:
            self.rt.release(job.handoff_id)
        elif job.prompt_hash is not None:
            self.rt.loop.abort(job.handoff_id)
        job.finish()

    def _end(self, job: PushJob, reason: str, status: int = 409) -> bool:
        """The prompt failed or was refused, or the decode side is gone: tell a registered decode
        worker, wake the answer. A prompt that arrives later gets `status`. A job the writer has
        started ends with its WRITE instead."""
        with job.lock:
            if job.started or self.rt.table.claim(job.handoff_id, reason, job, status) is None:
                return False
        job.failed = reason
        self._tell_decode(job, M.Failed(handoff_id=job.handoff_id, reason=reason))
        job.finish()
        return True

    def _tell_decode(self, job: PushJob, note: M.Failed) -> None:
        """Tell the registered decode worker (if any) that no more KV will come for this ended job,
        once that is true: layer-wise WRITEs may be posted or queued, and the decode worker frees its
        blocks on this word. The writer runs in order and a queued layer WRITE of a failed job posts
        nothing, so a word queued behind them goes out when the last posted one is in; one still in
        flight after the WRITE timeout leaves the word unsaid (the decode side's settle time covers it)."""
        peer = job.peer
        if peer is None:
            return
        if not job.committed:           # no layer-wise WRITE was ever queued for it
            self.rt.notify(peer, note)
            return

        def after_writes() -> None:
            for handle in job.pending:
                try:
                    handle.wait(self.rt.cfg.kv_timeout_s)
                except TransferTimeout:
                    log.warning("handoff %s: a layer WRITE is still in flight; its decode worker keeps the "
                                "blocks until its settle time", job.handoff_id)
                    return
                except TransferError:
                    pass                # failed: it lands nothing more
            self.rt.notify(peer, note)
        self.rt.writer.put(after_writes)

    def _decode_cancelled(self, peer: str, note: M.Cancel, job: PushJob) -> None:
        """A decode worker gave up. Once the handoff was moved (late binding), only the one that
        holds its current registration speaks for it."""
        with job.lock:
            if job.binding and peer != job.peer:
                return
        self.cancel(job)

    def _renewed(self, peer: str, note: M.Renew, job: PushJob) -> None:
        job.renewed_at = time.monotonic()

    def _peer_lost(self, peer: str, reason: str) -> None:
        """The decode worker holding a registration died: its prompt has nowhere to go."""
        for job in self.rt.table.entries(PushJob):
            with job.lock:
                if job.peer != peer or job.started:
                    continue
            if self._end(job, f"KV write to {job.registration.decode_worker} failed: its agent is gone ({reason})", 502):
                if job.prefilled is not None:
                    self.rt.release(job.handoff_id)
                elif job.prompt_hash is not None:
                    self.rt.loop.abort(job.handoff_id)

    def _housekeep(self, now: float) -> None:
        for job in self.rt.table.entries(PushJob):
            if job.started:
                continue
            if job.registration is None or job.prompt_hash is None:
                # One half came and the other did not. (A registered prompt being computed is not
                # expired here: its WRITE is bound by decode's renewals instead.)
                if now - job.arrival > 2 * self.rt.cfg.kv_timeout_s:
                    log.warning("handoff %s: no %s within %.0fs, dropped", job.handoff_id,
                                "registration" if job.registration is None else "prompt", 2 * self.rt.cfg.kv_timeout_s)
                    self._end(job, "the other side of the handoff never arrived")
                    if job.prefilled is not None:
                        self.rt.release(job.handoff_id)
            else:
                self._keep_alive(job, now, self._computed(job))

    def _keep_alive(self, job: PushJob, now: float, computed: int) -> None:
        """Progress to a registered decode worker, at most every ttl / 3 and only when more of the
        prompt was computed. Also checked as the prompt completes: its WRITE starts then, and the
        housekeeper skips started jobs, so without it a prompt computed in one step late in the ttl
        left decode a sliver of its deadline for the WRITE (a slow link's included) and it recomputed
        (issue 11 bug 4, seen again on a busy 2-core AMD machine)."""
        with job.lock:
            if job.registration is None or now - job.progress_at <= job.ttl_s / 3 or computed <= job.progress_tokens:
                return
            job.progress_at, job.progress_tokens = now, computed
        self.rt.notify(job.peer, M.Progress(handoff_id=job.handoff_id))

    def _computed(self, job: PushJob) -> int:
        """Prompt tokens the engine has computed so far (a racy read of one int, enough to tell
        progress from none)."""
        request = self.rt.engine.requests.get(job.handoff_id)
        return 0 if request is None else request.num_computed_tokens


# ---------------------------------------------------------------------------------------------------
# Decode side

class PushDecode(DecodeSide):
    def __init__(self, rt: Runtime):
        super().__init__(rt)
        self.aio: asyncio.AbstractEventLoop | None = None
        self._to_register: list[tuple[Incoming, str, M.Registration]] = []   # engine thread
        self._prefill_peers: dict[str, str] = {}        # prefill URL -> its agent's peer name
        rt.on(M.Done, Incoming, self._last_word(lambda note, incoming: self._done(incoming, note)))
        # (A cancelled handoff: the router gave up on the request, and tells us too; nothing to recompute.)
        rt.on(M.Failed, Incoming, self._last_word(lambda note, incoming: self.rt.fail(
            incoming, f"prefill worker reported: {note.reason}",
            recompute=False if note.reason == CANCELLED else None)))
        rt.on(M.Progress, Incoming, self._progress)
        rt.on(M.Withdrawn, Incoming, self._last_word(lambda note, incoming: self.rt.fail(
            incoming, "the router moved the request to another decode worker (late binding)", recompute=False)))
        rt.on(M.Withdrawn, None, self._late)
        # A Progress sent as the prompt completed may overtake its WRITE's Done or trail it: harmless.
        rt.on(M.Progress, None, lambda peer, note, entry: None)
        rt.on(M.Done, None, self._late)
        rt.on(M.Failed, None, self._late)
        rt.every_tick(self._deadlines)
        rt.on_peer_lost(self._prefill_lost)

    def _prefill_lost(self, peer: str, reason: str) -> None:
        """A prefill worker's agent died (SIGKILL, crash): a dead writer writes no more, so every handoff
        waiting on it is recomputed (or failed, by policy) now, its blocks free at once, instead of at
        the write deadline. Its WRITEs come only over that connection or from that process."""
        for incoming in self.rt.table.entries(Incoming):
            if incoming.side is self and incoming.peer == peer:
                self.rt.fail(incoming, f"the prefill worker's agent is gone ({reason})")

    def writer_gone(self, incoming: Incoming) -> bool:
        """Whether the prefill that would write this handoff's blocks can no longer write anything."""
        return incoming.peer is not None and incoming.peer not in self.rt.agent.peers

    def fail_reported(self, incoming: Incoming, reason: str, settled: bool, recompute: bool | None) -> bool:
        # The router saw the prefill leg fail; when its agent's death was seen first, nothing is left
        # to set the blocks aside for.
        return super().fail_reported(incoming, reason, settled or self.writer_gone(incoming), recompute)

    async def decode(self, kv: M.PushDecodeParams, prompt_ids: list[int], params: SamplingParams, on_output) -> None:
        """Queue the request; once blocks are reserved it registers them with the prefill worker."""
        self.aio = asyncio.get_running_loop()
        self.rt.refuse_ended(kv.handoff_id)
        peer = await self._prefill_peer(kv.prefill_url)
        incoming = Incoming(kv.handoff_id, len(prompt_ids), peer=peer, mode=kv.mode)
        incoming.extra.update(prefill_url=kv.prefill_url, prompt_hash=prompt_hash(prompt_ids), binding=kv.binding)
        self.submit(kv, incoming, prompt_ids, params, on_output)

    async def _prefill_peer(self, url: str) -> str:
        peer = self._prefill_peers.get(url)
        # A worker restarted at the same URL has a new agent: a cached name whose connection died
        # would send our Cancels nowhere and never hear of the new one's death.
        if peer is None or peer not in self.rt.agent.peers:
            info = await self.rt.control.get(url, "/kv/info")
            try:
                peer = await self.rt.peer(info["agent_metadata"])
            except HandoffError as exc:     # it answered /kv/info and died before the handshake: name it
                raise HandoffError(f"prefill worker {url}: {exc}", exc.status, exc.code) from None
            self._prefill_peers[url] = peer
        return peer

    def reserved(self, incoming: Incoming, request, num_local_tokens: int) -> None:
        """Engine thread, scheduler half: the destination exists; its registration goes out next."""
        self.note_reserved(incoming, request, num_local_tokens)
        now, ttl = time.monotonic(), self.rt.cfg.kv_timeout_s
        incoming.deadline, incoming.settle_at = now + ttl, now + 2 * ttl
        registration = M.Registration(
            handoff_id=incoming.handoff_id, mode=incoming.mode, decode_worker=self.rt.worker_name,
            agent_metadata=self.rt.metadata_b64(), block_ids=incoming.block_ids, pool_blocks=self.rt.layout.num_blocks,
            num_kv_tokens=incoming.num_kv_tokens,
            skip_blocks=incoming.skip_blocks, prompt_hash=incoming.extra["prompt_hash"], ttl_ms=ms(ttl),
            protocol_version=M.PROTOCOL_VERSION, binding=incoming.extra["binding"])
        self._to_register.append((incoming, incoming.extra["prefill_url"], registration))

    def start_loads(self) -> None:
        """Engine thread, worker half: hand this step's registrations to asyncio (never waits)."""
        posting, self._to_register = self._to_register, []
        for incoming, url, registration in posting:
            self.aio.call_soon_threadsafe(asyncio.ensure_future, self._register(incoming, url, registration))

    async def _register(self, incoming: Incoming, url: str, registration: M.Registration) -> None:
        if self.rt.table.get(incoming.handoff_id) is not incoming:
            # Ended before its registration went out (the router reported the prefill failed, or
            # cancelled): nobody will be asked to write into these blocks, so none stay set aside.
            self.rt.settle(incoming.request_id)
            return
        try:
            status, body = await self.rt.control.post(url, "/kv/register", registration.to_dict())
        except ConnectionError as exc:
            # It may or may not have arrived: keep the blocks aside until the push deadline passes.
            self.rt.fail(incoming, f"registration with {url} failed: {exc}", settled=self.writer_gone(incoming))
            return
        if status >= 400:
            error = (body.get("error") or {}) if isinstance(body, dict) else {}
            # Moved away (late binding): the router has the request served elsewhere; nothing to recompute.
            self.rt.fail(incoming, f"prefill refused the registration: {error.get('message') or status}",
                         recompute=False if error.get("code") == MOVED else None)
            self.rt.settle(incoming.request_id)     # refused: nothing will be written for it
        else:
            self.rt.cfg.faults.reached("registered", incoming.handoff_id)

    def _done(self, incoming: Incoming, note: M.Done) -> None:
        incoming.checksums, incoming.first_token = note.checksums, note.first_token
        incoming.bytes = len(incoming.transferred_blocks) * self.rt.layout.block_bytes
        self.rt.arrived(incoming)

    def _progress(self, peer: str, note: M.Progress, incoming: Incoming) -> None:
        """The prefill is still computing our prompt: wait longer, and move the set-aside time on
        before the Renew goes out (the timing rule)."""
        if incoming.deadline is None:
            return
        now = time.monotonic()
        incoming.deadline, incoming.settle_at = now + self.rt.cfg.kv_timeout_s, now + 2 * self.rt.cfg.kv_timeout_s
        if self.rt.table.get(incoming.handoff_id) is incoming:     # (given up meanwhile: no Renew)
            self.rt.notify(peer, M.Renew(handoff_id=note.handoff_id))

    def _last_word(self, handle: Callable[[object, Incoming], object]) -> Callable[[str, object, Incoming], None]:
        """Done, Failed and Withdrawn are the prefill's last word on a handoff: once one is handled,
        no WRITE lands in its blocks any more. Blocks set aside meanwhile (the request ended while the
        word was on its way, so `handle` found the handoff claimed) go back now, not at the settle time."""
        def handler(peer: str, note, incoming: Incoming) -> None:
            handle(note, incoming)
            self.rt.settle(incoming.request_id)
        return handler

    def _late(self, peer: str, note, entry) -> None:
        """Done, Failed or Withdrawn for a handoff we gave up on: its blocks were waiting for exactly this."""
        if not self.rt.settle(note.handoff_id):
            self.rt.counters.bump("late_notifications")

    def _deadlines(self, now: float) -> None:
        for incoming in self.rt.table.entries(Incoming):
            if incoming.side is self and incoming.deadline is not None and now > incoming.deadline:
                self.rt.notify(incoming.peer, M.Cancel(handoff_id=incoming.handoff_id))
                self.rt.fail(incoming, f"no KV from the prefill worker within {self.rt.cfg.kv_timeout_s:.0f}s",
                             settled=False)

    def ended_early(self, incoming: Incoming) -> None:
        self.rt.notify(incoming.peer, M.Cancel(handoff_id=incoming.handoff_id))
