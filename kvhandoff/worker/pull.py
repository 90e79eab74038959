"""Pull and pull-reader (docs/HANDOFF.md, "Pull and pull-reader"), driven: protocol/pull_prefill.py
and protocol/arrival.py decide, this file does.

The prefill worker computes the prompt and samples its first token, pins the prompt's blocks under
a lease and answers where they are (messages.PullHandoff). Only then does the router pick the decode
worker (late binding: the load as it is now), which reserves blocks, READs the KV into them, verifies
the checksums and releases the lease. `pull` posts the READ from the engine thread at the step that
reserved the blocks; `pull-reader` leaves posting to the reader thread too.

Failure edges, and who ends each (the machines' first end state decides the one outcome):
- the READ fails, or the bytes fail verification: decode recomputes (or fails, by policy); Release
  goes out either way, so the lease is not held for nothing.
- the lease runs out before the READ: prefill frees the blocks; a late READ gets other bytes, whose
  checksums disagree: recompute, never garbage.
- decode queues for blocks longer than a lease: it renews the lease (Renew, every lease / 3).
- the decode request ends before its K/V landed (client gone): Release at once; blocks a READ may
  still be filling are set aside until it ends.
- the prefill worker dies: the agent sees its connection die and decode recomputes at once.
- the router gives up (client gone before the decode leg): /kv/cancel or /kv/release frees the pin.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvhandoff.engine.request import RequestOutput, SamplingParams
from kvhandoff.transfer.errors import TransferError
from kvhandoff.wire import messages as M
from kvhandoff.wire.modes import FinishReason
from kvhandoff.worker.arrivals import DecodeSide, Incoming
from kvhandoff.worker.chores import Chores
from kvhandoff.worker.errors import HandoffError
from kvhandoff.worker.mailbox import Mailbox
from kvhandoff.worker.protocol import arrival as A
from kvhandoff.worker.protocol import pull_prefill as P
from kvhandoff.worker.protocol.actions import AbortPrompt, Count, End, ReleaseBlocks, Warn
from kvhandoff.worker.reuse import FetchingPrefill

log = logging.getLogger("kvhandoff.handoff")


# ---------------------------------------------------------------------------------------------------
# Prefill side

@dataclass(eq=False)
class PullPin:
    """Prefill side of one pull handoff: its state (protocol/pull_prefill.py), changed under `lock`."""
    handoff_id: str
    state: P.Pin = None
    fetch: Incoming | None = None           # bidirectional: history read back before computing
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        self.state = self.state or P.Pin(self.handoff_id)


class PullPrefill(FetchingPrefill):
    def __init__(self, *, mail: Mailbox, **parts):
        super().__init__(**parts)
        mail.on(M.Release, PullPin, lambda peer, note, pin: self.step(pin, P.Released()))
        mail.on(M.Renew, PullPin, lambda peer, note, pin: self.step(pin, P.Renewed(time.monotonic(), self.cfg.lease_s)))
        self.chores.every_tick(self._tick)

    def step(self, pin: PullPin, event) -> list:
        with pin.lock:
            pin.state, actions = P.step(pin.state, event)
            for action in actions:
                kind = type(action)
                if kind is End:
                    self.table.claim(pin.handoff_id, action.reason, pin, action.status)
                elif kind is ReleaseBlocks:
                    self.door.release(pin.handoff_id)
                elif kind is AbortPrompt:
                    self.door.abort(pin.handoff_id)     # finished() then finds it ended: nothing pinned
                elif kind is Count:
                    self.counters.bump(action.name)
                elif kind is Warn:
                    log.warning("%s", action.message)
        return actions

    async def prefill(self, kv: M.PullPrefillParams, prompt_ids: list[int], params: SamplingParams,
                      on_submitted: Callable[[], None], on_first: Callable[[RequestOutput], None]) -> dict:
        """Compute the prompt (its first token goes to `on_first` at once), pin its KV, answer the
        handoff object (the router's prefill leg)."""
        pin = self.table.add(kv.handoff_id, PullPin(kv.handoff_id))
        out, reuse_report = await self.compute(pin, kv, prompt_ids, params, on_submitted)
        on_first(out)
        checksums = await self.chores.blocking(self.door.checksums, out.kv_block_ids)
        return M.PullHandoff(
            handoff_id=kv.handoff_id, prefill_worker=self.worker_name, prompt_token_ids=prompt_ids,
            num_kv_tokens=out.num_kv_tokens, first_token_id=out.new_token_ids[0], block_ids=out.kv_block_ids,
            pool_blocks=self.door.layout.num_blocks, checksums=checksums, lease_ms=M.ms(self.cfg.lease_s),
            agent_metadata=self.peers.metadata_b64(),
            phases_ms={"prefill_queue": out.timings["queue_ms"], "prefill_compute": out.timings["prefill_ms"]},
            **reuse_report).to_dict()

    def finished(self, pin: PullPin, request, out: RequestOutput) -> bool:
        """Engine thread: the prompt is computed; pin its blocks under the lease (unless the router
        gave up meanwhile: then they go straight back)."""
        self.fetch_ended(pin)
        if out.finish_reason != FinishReason.PREFILLED:
            self.step(pin, P.PromptFailed(f"prefill ended: {out.error or out.finish_reason}"))
            return False
        # One step under the pin's lock: a cancel that ended it before this saw nothing pinned (and
        # aborted a request that had finished already), so the blocks go back here; one after it
        # sees the pin and releases them.
        self.step(pin, P.Computed(time.monotonic(), self.cfg.lease_s))
        if pin.state.phase is not P.Phase.PINNED:
            return False
        self.observe(out)
        self.cfg.faults.reached("registered", pin.handoff_id)
        return True

    def release(self, handoff_id: str) -> bool:
        """Decode read the KV, or will not (Release, /kv/release): unpin it. False if not pinned here."""
        pin = self.table.get(handoff_id)
        return isinstance(pin, PullPin) and any(isinstance(a, ReleaseBlocks) for a in self.step(pin, P.Released()))

    def cancel(self, pin: PullPin) -> None:
        """The router gave up: stop computing, or unpin."""
        self.step(pin, P.Cancelled())

    def refused(self, handoff_id: str, reason: str) -> None:
        pin = self.table.get(handoff_id)
        if isinstance(pin, PullPin):
            self.step(pin, P.PromptFailed(f"the prefill worker refused the request: {reason}"))

    def _tick(self, now: float) -> None:
        for pin in self.table.entries(PullPin):
            self.step(pin, P.Tick(now))


# ---------------------------------------------------------------------------------------------------
# Decode side

class PullDecode(DecodeSide):
    kind = A.Kind.PULL

    def __init__(self, *, chores: Chores, mail: Mailbox, **parts):
        super().__init__(**parts)
        self.chores, self.mail = chores, mail
        self._to_post: list[Incoming] = []     # reserved this step; `pull` posts their READs (engine thread)

    async def decode(self, kv: M.PullDecodeParams, prompt_ids: list[int], params: SamplingParams, on_output) -> None:
        """Queue the request; its KV is READ from the prefill worker once blocks are reserved."""
        self.table.refuse_ended(kv.handoff_id)
        remote = kv.remote
        if remote.num_kv_tokens != len(prompt_ids) or remote.prompt_token_ids != prompt_ids:
            raise HandoffError("the handoff object does not match the prompt", 400)
        if not self.door.is_token(remote.first_token_id):
            raise HandoffError("the handoff object lacks a valid first_token_id", 400)
        if len(remote.checksums) != len(remote.block_ids):
            raise HandoffError("the handoff object has a checksum per block, or it is malformed", 400)
        remote_layout = self.door.layout.checked_peer(remote.pool_blocks, remote.block_ids, "the handoff object")
        peer = await self.peers.peer(remote.agent_metadata)
        incoming = self.incoming(kv, len(prompt_ids), peer, remote_blocks=list(remote.block_ids),
                                 remote_layout=remote_layout, checksums=list(remote.checksums),
                                 first_token=remote.first_token_id)
        self.submit(kv, incoming, prompt_ids, params, on_output)

    def post_read(self, incoming: Incoming) -> None:
        """Engine thread (the machine's PostRead at reservation): the READ covers the blocks we lack."""
        self.cfg.faults.reached("registered", incoming.handoff_id)
        incoming.transfer_started = time.monotonic()
        if incoming.mode.reader_thread:
            self.chores.reader.put(lambda: self._read(incoming, None), self.cfg.faults.due())
        else:
            self._to_post.append(incoming)

    def start_loads(self) -> None:
        """Engine thread, worker half: post this step's READs (posting never waits); the reader
        thread waits for them."""
        posting, self._to_post = self._to_post, []
        for incoming in posting:
            try:
                handle = self._post_read(incoming)
            except TransferError as exc:
                handle = exc
            self.chores.reader.put(lambda i=incoming, h=handle: self._read(i, h), self.cfg.faults.due())

    def _post_read(self, incoming: Incoming):
        return self.peers.read(incoming.peer, self.door.layout.block_descs(incoming.transferred_blocks),
                               incoming.remote_layout.block_descs(incoming.remote_blocks))

    def _read(self, incoming: Incoming, handle) -> None:
        """Reader thread: wait for the READ (posting it first for pull-reader), verify, release."""
        faults = self.cfg.faults
        try:
            if isinstance(handle, Exception):
                raise handle
            handle = handle or self._post_read(incoming)
            faults.reached("transfer", incoming.handoff_id)
            if faults.read_fail:
                raise TransferError("injected READ failure (--inject-faults read_fail)")
            handle.wait(self.cfg.kv_timeout_s)
            incoming.bytes = handle.nbytes
            incoming.transfer_s = time.monotonic() - incoming.transfer_started
            self.arrivals.arrived(incoming)
        except Exception as exc:
            self.arrivals.fail(incoming, f"KV read from {incoming.peer} failed: {exc}")
        finally:
            self.mail.notify(incoming.peer, M.Release(handoff_id=incoming.handoff_id))
            self.arrivals.settle(incoming.request_id)     # ended while we read: its blocks waited for us

    def report_transfer(self, incoming: Incoming) -> float | None:
        return M.ms(incoming.transfer_s) if incoming.failure is None else None    # decode moved the bytes
