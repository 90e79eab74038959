"""Push (docs/HANDOFF.md, "Push and push-layerwise"), driven: protocol/push_prefill.py and
protocol/arrival.py decide, this file does; layerwise.py extends the prefill side.

The router picks the decode worker at arrival (early binding) and sends both legs at once. The
decode worker reserves the destination blocks and registers them with the prefill worker
(messages.Registration, a notification between their agents); the prefill's writer thread matches
registration and computed prompt, in either order, WRITEs the blocks and sends Done (riding on the
last WRITE) with the checksums and the first token; decode verifies and decodes. Push moves the
same bytes as pull: it reorders the dependencies, so that preparing the destination overlaps the
prompt's computation.

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
the handoff to another decode worker (POST /kv/rebind with the next `binding` number). Only while no
WRITE has started (push-layerwise: no layer written to it yet), the registration is withdrawn and the
decode worker that made it is told (Withdrawn: no WRITE will land in its blocks, so it frees them at
once); from then on only a registration of the new binding is taken, and a Cancel from the decode
worker moved away from no longer speaks for the handoff.

Failure edges (each end is told at once where the other side knows):
- the WRITE fails: prefill sends Failed, decode recomputes (or fails, by policy).
- the prompt fails or is refused on prefill: Failed to a registered decode worker; one that registers
  later is told Failed; the router also reports it (/kv/failed).
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
from kvhandoff.wire.modes import FinishReason
from kvhandoff.worker.arrivals import DecodeSide, Incoming
from kvhandoff.worker.errors import HandoffError
from kvhandoff.worker.mailbox import Mailbox
from kvhandoff.worker.protocol import arrival as A
from kvhandoff.worker.protocol import layers as L
from kvhandoff.worker.protocol import push_prefill as S
from kvhandoff.worker.protocol.actions import AbortPrompt, Count, End, Notify, Refuse, ReleaseBlocks, Warn
from kvhandoff.worker.reuse import FetchingPrefill

CANCELLED = S.CANCELLED
# The final WRITE waits (on the writer thread) for the prompt's first token to leave, at most this
# long: started as the prompt completes, its checksums and copies took the prefill's core and GIL
# from the first token's way out (push's TTFT less each side's compute, tiny on a 2-core Zen 4, 4
# alternated runs: 2,048 tokens 2.17 -> 1.39 ms, push-layerwise 2.71 -> 1.33). The decode worker
# needs the KV only for its second token, a step after the first.
FIRST_LINE_WAIT_S = 0.01
log = logging.getLogger("kvhandoff.handoff")


# ---------------------------------------------------------------------------------------------------
# Prefill side

@dataclass(eq=False)
class PushJob:
    """Prefill side of one push handoff: its state (protocol/push_prefill.py, changed under `lock`), the
    computed prompt, and what its WRITEs measured."""
    handoff_id: str
    state: S.Job = None
    prefilled: RequestOutput | None = None  # set when the prompt is computed (its blocks pinned)
    prefilled_at: float | None = None
    queued_at: float | None = None          # handed to the writer
    phases: dict = field(default_factory=dict)
    bytes_sent: int = 0
    fetch: Incoming | None = None           # bidirectional: history read back before computing
    # push-layerwise (layerwise.py): what left while the prompt was being computed
    layers: L.Plan | None = None
    pending: list = field(default_factory=list)     # the layer WRITEs' handles
    prefilled_perf: float = 0.0             # when the prompt was computed (perf_counter, as handles)
    bytes_before_prefill_end: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    finished: threading.Event = field(default_factory=threading.Event, repr=False)
    first_sent: threading.Event = field(default_factory=threading.Event, repr=False)  # its line left for the router
    waiters: list = field(default_factory=list)     # callbacks for the end (written, failed, cancelled)

    def __post_init__(self):
        self.state = self.state or S.Job(self.handoff_id, time.monotonic())

    def finish(self) -> None:
        self.finished.set()
        for callback in self.waiters:
            callback()


class PushPrefill(FetchingPrefill):
    def __init__(self, *, mail: Mailbox, **parts):
        super().__init__(**parts)
        self.mail = mail
        mail.on(M.Renew, PushJob, lambda peer, note, job: self.step(job, S.Renewed(time.monotonic())))
        mail.on(M.Cancel, PushJob, lambda peer, note, job: self.step(job, S.Cancelled(by_peer=peer)))
        for entry_type in (PushJob, None):      # (either order with the prompt)
            mail.on(M.Registration, entry_type, lambda peer, note, entry: self.registration_arrived(note, peer))
        self.peers.on_lost(lambda peer, reason: [self.step(job, S.PeerLost(peer, reason))
                                                 for job in self.table.entries(PushJob)])
        self.chores.every_tick(self._tick)

    def step(self, job: PushJob, event) -> list:
        """Feed the job's machine one event and carry its actions out (all under its lock); a Refuse
        is raised once the lock is let go."""
        with job.lock:
            job.state, actions = S.step(job.state, event)
            for action in actions:
                self._do(job, action)
        refusal = next((a for a in actions if type(a) is Refuse), None)
        if refusal is not None:
            raise HandoffError(refusal.message, refusal.status, refusal.code)
        return actions

    def _do(self, job: PushJob, action) -> None:
        kind = type(action)
        if kind is End:
            self.table.claim(job.handoff_id, action.reason, job, action.status)
        elif kind is Notify:
            if action.after_writes:
                self._notify_after_writes(job, action.peer, action.note)
            else:
                self.mail.notify(action.peer, action.note)
        elif kind is S.StartWrite:
            job.queued_at = time.monotonic()
            self.chores.writer.put(lambda: self._write(job), self.cfg.faults.due())
        elif kind is ReleaseBlocks:
            self.door.release(job.handoff_id)
        elif kind is AbortPrompt:
            self.door.abort(job.handoff_id)
        elif kind is S.Finish:
            job.finish()
        elif kind is Count:
            self.counters.bump(action.name)
        elif kind is Warn:
            log.warning("%s", action.message)
        else:
            assert kind is Refuse, action

    async def prefill(self, kv: M.PushPrefillParams, prompt_ids: list[int], params: SamplingParams,
                      on_submitted: Callable[[], None], on_first: Callable[[RequestOutput], None]) -> dict:
        """Compute the prompt (its first token goes to `on_first` at once), wait for its WRITE (or its
        failure), answer (the router's prefill leg)."""
        job = self.table.get_or_add(kv.handoff_id, lambda: PushJob(kv.handoff_id))
        self.step(job, S.PromptArrived(M.prompt_hash(prompt_ids), kv.mode.layerwise))
        out, reuse_report = await self.compute(job, kv, prompt_ids, params, on_submitted)
        on_first(out)
        await self._wait(job)
        if job.state.failed:
            raise HandoffError(job.state.failed, 502)
        return M.PushPrefillAnswer(
            handoff_id=kv.handoff_id, prefill_worker=self.worker_name, num_kv_tokens=out.num_kv_tokens,
            blocks=len(out.kv_block_ids or []), bytes_transferred=job.bytes_sent, **self.extra_answer(job),
            phases_ms={"prefill_queue": out.timings["queue_ms"], "prefill_compute": out.timings["prefill_ms"],
                       **job.phases}, **reuse_report).to_dict()

    def extra_answer(self, job: PushJob) -> dict:
        return {}

    def ended_by_peer(self, job: PushJob) -> str | None:
        return job.state.failed

    async def _wait(self, job: PushJob) -> None:
        """Wait for the job's end without holding a thread (with one per waiting prefill, a burst
        of push requests once took every thread, and the registrations they waited for starved)."""
        aio, ended = asyncio.get_running_loop(), asyncio.Event()
        job.waiters.append(lambda: aio.call_soon_threadsafe(ended.set))
        if not job.finished.is_set():
            try:
                await asyncio.wait_for(ended.wait(), 4 * self.cfg.kv_timeout_s)
            except TimeoutError:
                raise HandoffError(f"the KV write of handoff {job.handoff_id} did not end within "
                                   f"{4 * self.cfg.kv_timeout_s:.0f} s", 504) from None

    def refused(self, handoff_id: str, reason: str) -> None:
        """The prefill leg was refused before it started (busy, invalid): a registered decode worker
        hears it at once, and one that registers later is refused."""
        job = self.table.get(handoff_id)
        if isinstance(job, PushJob):
            self.step(job, S.PromptFailed(f"the prefill worker refused the request: {reason}"))
        else:
            self.table.end(handoff_id, f"the prefill worker refused the request: {reason}")

    def finished(self, job: PushJob, request, out: RequestOutput) -> bool:
        """Engine thread: the prompt is computed (keep its blocks pinned for the WRITE) or failed."""
        self.fetch_ended(job)
        if out.finish_reason != FinishReason.PREFILLED:
            self.step(job, S.PromptFailed(out.error or f"prefill ended: {out.finish_reason}"))
            return False
        job.prefilled, job.prefilled_at = out, time.monotonic()
        # One step under the job's lock: whoever ended the job before it saw nothing computed, so the
        # blocks go back here (the engine frees them); whoever ends it after releases them.
        self.step(job, S.Computed(job.prefilled_at, out.num_kv_tokens))
        if job.state.phase is S.Phase.ENDED:
            return False
        self.observe(out)
        return True

    def first_token_sent(self, handoff_id: str) -> None:
        job = self.table.get(handoff_id)
        if isinstance(job, PushJob):
            job.first_sent.set()

    def registration_arrived(self, registration: M.Registration, sender: str) -> None:
        """Receiver thread: a decode worker's registration. Its agent is usually connected already (it
        is ours to WRITE to); a first one's handshake waits on a thread of the pool instead, so that no
        other notification waits behind it."""
        peer = self.peers.known(registration.agent_metadata)
        if peer is not None:
            self._register_or_tell(registration, peer, sender)
        else:
            self.chores.soon(self._register_or_tell, registration, None, sender)

    def _register_or_tell(self, registration: M.Registration, peer: str | None, sender: str) -> None:
        try:
            self._check(registration)
            peer = peer or self.peers.connect(registration.agent_metadata)
        except HandoffError as exc:
            log.warning("handoff %s: registration from %s refused: %s", registration.handoff_id, sender, exc)
            self.mail.notify(sender, M.Failed(handoff_id=registration.handoff_id, reason=f"registration refused: {exc}"))
            return
        try:
            self.register(registration, peer)
        except HandoffError as exc:     # (the decode worker was told: Failed, or Withdrawn if it was moved)
            log.info("handoff %s: registration from %s refused: %s", registration.handoff_id, sender, exc)

    def _check(self, registration: M.Registration) -> None:
        if not registration.ttl_ms > 0:
            raise HandoffError(f"ttl_ms must be a positive number of milliseconds, not {registration.ttl_ms!r}", 400)
        if not 0 <= registration.skip_blocks < len(registration.block_ids):
            raise HandoffError(f"skip_blocks must be a block index below the registered blocks, not "
                               f"{registration.skip_blocks!r}", 400)
        self.door.layout.checked_peer(registration.pool_blocks, registration.block_ids, "the registration")

    def register(self, registration: M.Registration, peer: str) -> None:
        """A checked registration, whose agent `peer` is connected: matched with its prompt (either
        order). A refusal is raised, after the registering worker was told."""
        handoff_id = registration.handoff_id
        try:
            job = self.table.get_or_add(handoff_id, lambda: PushJob(handoff_id))
        except HandoffError:
            self.mail.notify(peer, M.Failed(handoff_id=handoff_id, reason=self.table.ended(handoff_id) or "ended"))
            raise
        # (A fault that kills the worker here must come before the step that may start the WRITE.)
        self.cfg.faults.reached("registered", handoff_id)
        self.step(job, S.Registered(registration, peer, time.monotonic()))

    def rebind(self, rebind: M.Rebind) -> None:
        """Late binding: the router moves the handoff to another decode worker, whose registration
        will carry `rebind.binding`. 409 once a WRITE has started (the KV goes where it goes)."""
        job = self.table.get_or_add(rebind.handoff_id, lambda: PushJob(rebind.handoff_id))
        self.step(job, S.Rebound(rebind.binding, time.monotonic()))

    def cancel(self, job: PushJob) -> None:
        """The router gave up. A job the writer has started ends with its WRITE (the blocks it reads
        from must stay pinned until then). A registered decode worker hears that nothing (more) will
        be written, so it frees the blocks it set aside at once instead of at its settle time."""
        self.step(job, S.Cancelled())

    def _write(self, job: PushJob) -> None:
        """Writer thread: everything the layer-wise writes did not cover, then Done with the checksums."""
        job.first_sent.wait(FIRST_LINE_WAIT_S)
        out, state, handoff_id, faults = job.prefilled, job.state, job.handoff_id, self.cfg.faults
        reg, error = state.registration, None
        started = time.monotonic()
        # The computed prompt waited for its destination until queued_at; from then on it is the
        # transfer's time, the writer's queue and a slow link's delay included.
        job.phases["handoff_wait"] = M.ms(job.queued_at - job.prefilled_at)
        try:
            if started > state.renewed_at + state.ttl_s:
                raise HandoffError("the registration expired before the prompt was computed")
            if reg.prompt_hash != state.prompt_hash:
                raise HandoffError("the decode worker registered a different prompt (tokenizers disagree?)")
            if reg.num_kv_tokens != out.num_kv_tokens or len(reg.block_ids) != len(out.kv_block_ids):
                raise HandoffError(f"registration does not match the prompt: {reg.num_kv_tokens} vs "
                                   f"{out.num_kv_tokens} tokens")
            self.before_final_write(job)
            rest = slice(self.first_unsent_block(job), None)
            local, remote = out.kv_block_ids[rest], reg.block_ids[rest]
            checksums = self.door.checksums(out.kv_block_ids[reg.skip_blocks:])    # of what decode gets
            done = M.encode(M.Done(handoff_id=handoff_id, checksums=checksums, first_token=out.new_token_ids[0]))
            if faults.write_fail:
                raise TransferError("injected WRITE failure (--inject-faults write_fail)")
            if "done" in faults.drop:
                log.warning("fault injection: done notification for %s dropped", handoff_id)
                done = b""
            if local:
                layout = self.door.layout
                handle = self.peers.write(state.peer, layout.block_descs(local),
                                          layout.peer(reg.pool_blocks).block_descs(remote), notify=done)
                faults.reached("transfer", handoff_id)
                job.bytes_sent += handle.wait(self.cfg.kv_timeout_s).nbytes
            elif done:
                self.peers.send_now(state.peer, done)
        except (TransferError, HandoffError, OSError) as exc:
            error = f"KV write to {reg.decode_worker} failed: {exc}"
        finally:
            job.phases["transfer"] = M.ms(time.monotonic() - job.queued_at)
            if error is None:
                self.counters.bump("handoffs")
                self.counters.bump("bytes", job.bytes_sent)
            self.step(job, S.WriteEnded(error))

    # Layer-wise push (layerwise.py) sends most of the KV before this point.
    def before_final_write(self, job: PushJob) -> None:
        pass

    def first_unsent_block(self, job: PushJob) -> int:
        return job.state.registration.skip_blocks

    def _notify_after_writes(self, job: PushJob, peer: str, note) -> None:
        """Tell the decode worker, once no layer-wise WRITE can land any more: it frees its blocks on
        this word. The writer runs in order and a queued layer WRITE of an ended job posts nothing,
        so a word queued behind them goes out when the last posted one is in; one still in flight
        after the WRITE timeout leaves the word unsaid (the decode side's settle time covers it)."""
        def after_writes() -> None:
            for handle in job.pending:
                try:
                    handle.wait(self.cfg.kv_timeout_s)
                except TransferTimeout:
                    log.warning("handoff %s: a layer WRITE is still in flight; its decode worker keeps the "
                                "blocks until its settle time", job.handoff_id)
                    return
                except TransferError:
                    pass                # failed: it lands nothing more
            self.mail.notify(peer, note)
        self.chores.writer.put(after_writes)

    def _tick(self, now: float) -> None:
        for job in self.table.entries(PushJob):
            if job.state.phase not in (S.Phase.WRITING, S.Phase.ENDED):
                self.step(job, S.Tick(now, self.door.computed_tokens(job.handoff_id), self.cfg.kv_timeout_s))


# ---------------------------------------------------------------------------------------------------
# Decode side

class PushDecode(DecodeSide):
    kind = A.Kind.PUSH

    def __init__(self, *, mail: Mailbox, control, counters, **parts):
        super().__init__(**parts)
        self.mail, self.control, self.counters = mail, control, counters
        self._to_register: list[tuple[Incoming, M.Registration]] = []   # engine thread
        self._prefill_peers: dict[str, str] = {}        # prefill URL -> its agent's peer name
        mail.on(M.Done, Incoming, self._last_word(lambda note, incoming: self._done(incoming, note)))
        # (A cancelled handoff: the router gave up on the request, and tells us too; nothing to recompute.)
        mail.on(M.Failed, Incoming, self._last_word(lambda note, incoming: self.arrivals.fail(
            incoming, f"prefill worker reported: {note.reason}",
            recompute=False if note.reason == CANCELLED else None)))
        mail.on(M.Progress, Incoming, lambda peer, note, incoming: self.arrivals.step(
            incoming, A.Progress(time.monotonic(), self.cfg.kv_timeout_s)))
        mail.on(M.Withdrawn, Incoming, self._last_word(lambda note, incoming: self.arrivals.fail(
            incoming, "the router moved the request to another decode worker (late binding)", recompute=False)))
        mail.on(M.Withdrawn, None, self._late)
        # A Progress sent as the prompt completed may overtake its WRITE's Done or trail it: harmless.
        mail.on(M.Progress, None, lambda peer, note, entry: None)
        mail.on(M.Done, None, self._late)
        mail.on(M.Failed, None, self._late)

    def writer_gone(self, incoming: Incoming) -> bool:
        """Whether the prefill that would write this handoff's blocks can no longer write anything."""
        return incoming.peer is not None and not self.peers.alive(incoming.peer)

    def fail_reported(self, incoming: Incoming, reason: str, settled: bool, recompute: bool | None) -> bool:
        # The router saw the prefill leg fail; when its agent's death was seen first, nothing is left
        # to set the blocks aside for.
        return super().fail_reported(incoming, reason, settled or self.writer_gone(incoming), recompute)

    async def decode(self, kv: M.PushDecodeParams, prompt_ids: list[int], params: SamplingParams, on_output) -> None:
        """Queue the request; once blocks are reserved it registers them with the prefill worker."""
        self.table.refuse_ended(kv.handoff_id)
        peer = await self._prefill_peer(kv.prefill_url)
        incoming = self.incoming(kv, len(prompt_ids), peer)
        incoming.extra.update(prompt_hash=M.prompt_hash(prompt_ids), binding=kv.binding)
        self.submit(kv, incoming, prompt_ids, params, on_output)

    async def _prefill_peer(self, url: str) -> str:
        peer = self._prefill_peers.get(url)
        # A worker restarted at the same URL has a new agent: a cached name whose connection died
        # would send our Cancels nowhere and never hear of the new one's death.
        if peer is None or not self.peers.alive(peer):
            info = await self.control.get(url, "/kv/info")
            try:
                peer = await self.peers.peer(info["agent_metadata"])
            except HandoffError as exc:     # it answered /kv/info and died before the handshake: name it
                raise HandoffError(f"prefill worker {url}: {exc}", exc.status, exc.code) from None
            self._prefill_peers[url] = peer
        return peer

    def register(self, incoming: Incoming) -> None:
        """Engine thread (the machine's Register at reservation): the destination exists; its
        registration goes out next."""
        registration = M.Registration(
            handoff_id=incoming.handoff_id, mode=incoming.mode, decode_worker=self.worker_name,
            agent_metadata=self.peers.metadata_b64(), block_ids=incoming.block_ids,
            pool_blocks=self.door.layout.num_blocks, num_kv_tokens=incoming.num_kv_tokens,
            skip_blocks=incoming.skip_blocks, prompt_hash=incoming.extra["prompt_hash"],
            ttl_ms=M.ms(self.cfg.kv_timeout_s), binding=incoming.extra["binding"])
        self._to_register.append((incoming, registration))

    def start_loads(self) -> None:
        """Engine thread, worker half: this step's registrations go to their prefill workers' agents
        (queued for the mailbox's sender: never waits). A refusal comes back as Failed or Withdrawn; a
        prefill that dies first is seen by our agent (PeerLost)."""
        posting, self._to_register = self._to_register, []
        for incoming, registration in posting:
            if incoming.state.phase.ended:
                # Ended before its registration went out (the router reported the prefill failed, or
                # cancelled): nobody will be asked to write into these blocks, so none stay set aside.
                self.arrivals.settle(incoming.request_id)
                continue
            self.mail.notify(incoming.peer, registration,
                             on_sent=lambda handoff_id=incoming.handoff_id: self.cfg.faults.reached("registered", handoff_id))

    def _done(self, incoming: Incoming, note: M.Done) -> None:
        incoming.checksums, incoming.first_token = note.checksums, note.first_token
        incoming.bytes = len(incoming.transferred_blocks) * self.door.layout.block_bytes
        self.arrivals.arrived(incoming)

    def _last_word(self, handle: Callable[[object, Incoming], object]) -> Callable[[str, object, Incoming], None]:
        """Done, Failed and Withdrawn are the prefill's last word on a handoff: once one is handled,
        no WRITE lands in its blocks any more. Blocks set aside meanwhile (the request ended while the
        word was on its way) go back now, not at the settle time."""
        def handler(peer: str, note, incoming: Incoming) -> None:
            handle(note, incoming)
            self.arrivals.settle(incoming.request_id)
        return handler

    def _late(self, peer: str, note, entry) -> None:
        """Done, Failed or Withdrawn for a handoff we gave up on: its blocks were waiting for exactly this."""
        if not self.arrivals.settle(note.handoff_id):
            self.counters.bump("late_notifications")
