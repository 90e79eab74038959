"""Pull and pull-reader (docs/HANDOFF.md, "Pull and pull-reader"), top to bottom.

The prefill worker computes the prompt and samples its first token, pins the prompt's blocks under
a lease and answers where they are (messages.PullHandoff). Only then does the router pick the decode
worker (late binding: the load as it is now), which reserves blocks, READs the KV into them, verifies
the checksums and releases the lease. `pull` posts the READ from the engine thread at the step that
reserved the blocks; `pull-reader` leaves posting to the reader thread too.

Failure edges, and who ends each (the table's claim decides the one outcome):
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
import time
from dataclasses import dataclass
from typing import Callable

from kvhandoff.engine.request import RequestOutput, SamplingParams
from kvhandoff.transfer.errors import TransferError
from kvhandoff.wire import messages as M
from kvhandoff.worker.reuse import FetchingPrefill, ReusePrefill
from kvhandoff.worker.runtime import DecodeSide, HandoffError, Incoming, Runtime, ms

log = logging.getLogger("kvhandoff.handoff")


# ---------------------------------------------------------------------------------------------------
# Prefill side

@dataclass
class PullPin:
    """Prefill side of one pull handoff: being computed, then pinned under a lease."""
    handoff_id: str
    lease_expiry: float | None = None       # set once the KV is pinned
    fetch: Incoming | None = None           # bidirectional: history read back before computing


class PullPrefill(FetchingPrefill):
    def __init__(self, rt: Runtime, reuse: ReusePrefill):
        super().__init__(rt, reuse)
        rt.on(M.Release, PullPin, lambda peer, note, pin: self.release(note.handoff_id))
        rt.on(M.Renew, PullPin, self._renew)
        rt.every_tick(self._expire)

    async def prefill(self, kv: M.PullPrefillParams, prompt_ids: list[int], params: SamplingParams,
                      on_first: Callable[[RequestOutput], None]) -> dict:
        """Compute the prompt (its first token goes to `on_first` at once), pin its KV, answer the
        handoff object (the router's prefill leg)."""
        pin = self.rt.table.add(kv.handoff_id, PullPin(kv.handoff_id))
        out, reuse_report = await self.compute(pin, kv, prompt_ids, params)
        on_first(out)
        checksums = await self.rt.blocking(self.rt.checksums, out.kv_block_ids)
        return M.PullHandoff(
            handoff_id=kv.handoff_id, prefill_worker=self.rt.worker_name, prompt_token_ids=prompt_ids,
            num_kv_tokens=out.num_kv_tokens, first_token_id=out.new_token_ids[0], block_ids=out.kv_block_ids,
            pool_blocks=self.rt.layout.num_blocks, checksums=checksums, lease_ms=ms(self.rt.cfg.lease_s),
            agent_metadata=self.rt.metadata_b64(),
            phases_ms={"prefill_queue": out.timings["queue_ms"], "prefill_compute": out.timings["prefill_ms"]},
            **reuse_report).to_dict()

    def finished(self, pin: PullPin, request, out: RequestOutput) -> bool:
        """Engine thread: the prompt is computed; pin its blocks under the lease (unless the router
        gave up meanwhile: then they go straight back)."""
        self.reuse.finished(pin.fetch)
        if out.finish_reason != "prefilled":
            self.rt.table.claim(pin.handoff_id, f"prefill ended: {out.error or out.finish_reason}", pin)
            return False
        # Pin first, then look: a cancel that claimed the handoff before this saw nothing pinned (and
        # aborted a request that had finished already), so the blocks go back here; one that claims it
        # after sees the lease and releases them. (Looking first left a pin nobody would free.)
        pin.lease_expiry = time.monotonic() + self.rt.cfg.lease_s
        if self.rt.table.get(pin.handoff_id) is not pin:
            return False
        self.observe(out)
        self.rt.cfg.faults.reached("registered", pin.handoff_id)
        return True

    def release(self, handoff_id: str) -> bool:
        """Decode read the KV, or will not (Release, /kv/release): unpin it. False if not pinned here."""
        pin = self.rt.table.get(handoff_id)
        if not isinstance(pin, PullPin) or pin.lease_expiry is None or \
                self.rt.table.claim(handoff_id, "released", pin) is None:
            return False
        self.rt.release(handoff_id)
        return True

    def cancel(self, pin: PullPin) -> None:
        """The router gave up: stop computing, or unpin."""
        if self.rt.table.claim(pin.handoff_id, "cancelled", pin) is None:
            return
        if pin.lease_expiry is None:
            self.rt.loop.abort(pin.handoff_id)      # finished() then finds it claimed: nothing pinned
        else:
            self.rt.release(pin.handoff_id)

    def _renew(self, peer: str, note: M.Renew, pin: PullPin) -> None:
        if pin.lease_expiry is not None:
            pin.lease_expiry = time.monotonic() + self.rt.cfg.lease_s

    def _expire(self, now: float) -> None:
        for pin in self.rt.table.entries(PullPin):
            if pin.lease_expiry is not None and pin.lease_expiry <= now and \
                    self.rt.table.claim(pin.handoff_id, "lease expired", pin) is not None:
                self.rt.counters.bump("lease_expiries")
                log.warning("handoff %s: lease expired, blocks freed", pin.handoff_id)
                self.rt.release(pin.handoff_id)


# ---------------------------------------------------------------------------------------------------
# Decode side

class PullDecode(DecodeSide):
    def __init__(self, rt: Runtime):
        super().__init__(rt)
        self._to_post: list[Incoming] = []     # reserved this step; `pull` posts their READs (engine thread)
        rt.every_tick(self._renew_queued)

    async def decode(self, kv: M.PullDecodeParams, prompt_ids: list[int], params: SamplingParams, on_output) -> None:
        """Queue the request; its KV is READ from the prefill worker once blocks are reserved."""
        self.rt.refuse_ended(kv.handoff_id)
        remote = kv.remote
        if remote.num_kv_tokens != len(prompt_ids) or remote.prompt_token_ids != prompt_ids:
            raise HandoffError("the handoff object does not match the prompt", 400)
        if not self.rt.is_token(remote.first_token_id):
            raise HandoffError("the handoff object lacks a valid first_token_id", 400)
        if len(remote.checksums) != len(remote.block_ids):
            raise HandoffError("the handoff object has a checksum per block, or it is malformed", 400)
        remote_layout = self.rt.peer_layout(remote.pool_blocks, remote.block_ids, "the handoff object")
        peer = await self.rt.peer(remote.agent_metadata)
        incoming = Incoming(kv.handoff_id, len(prompt_ids), peer=peer, mode=kv.mode, remote_blocks=list(remote.block_ids),
                            remote_layout=remote_layout, checksums=list(remote.checksums),
                            first_token=remote.first_token_id)
        self.submit(kv, incoming, prompt_ids, params, on_output)

    def reserved(self, incoming: Incoming, request, num_local_tokens: int) -> None:
        """Engine thread, scheduler half: blocks are reserved; the READ covers those we lack."""
        self.note_reserved(incoming, request, num_local_tokens)
        skip = incoming.skip_blocks
        incoming.remote_blocks, incoming.checksums = incoming.remote_blocks[skip:], incoming.checksums[skip:]
        self.rt.cfg.faults.reached("registered", incoming.handoff_id)
        incoming.transfer_started = time.monotonic()
        if incoming.mode.reader_thread:
            self.rt.reader.put(lambda: self._read(incoming, None), self.rt.cfg.faults.due())
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
            self.rt.reader.put(lambda i=incoming, h=handle: self._read(i, h), self.rt.cfg.faults.due())

    def _post_read(self, incoming: Incoming):
        return self.rt.agent.read(incoming.peer, self.rt.layout.block_descs(incoming.transferred_blocks),
                                  incoming.remote_layout.block_descs(incoming.remote_blocks))

    def _read(self, incoming: Incoming, handle) -> None:
        """Reader thread: wait for the READ (posting it first for pull-reader), verify, release."""
        faults = self.rt.cfg.faults
        try:
            if isinstance(handle, Exception):
                raise handle
            handle = handle or self._post_read(incoming)
            faults.reached("transfer", incoming.handoff_id)
            if faults.read_fail:
                raise TransferError("injected READ failure (--inject-faults read_fail)")
            handle.wait(self.rt.cfg.kv_timeout_s)
            incoming.bytes = handle.nbytes
            incoming.transfer_s = time.monotonic() - incoming.transfer_started
            self.rt.arrived(incoming)
        except Exception as exc:
            self.rt.fail(incoming, f"KV read from {incoming.peer} failed: {exc}")
        finally:
            self.rt.notify(incoming.peer, M.Release(handoff_id=incoming.handoff_id))
            self.rt.settle(incoming.request_id)     # ended while we read: its blocks waited for us

    def ended_early(self, incoming: Incoming) -> None:
        """The request ended before its K/V landed: the prefill can let the lease go now."""
        self.rt.notify(incoming.peer, M.Release(handoff_id=incoming.handoff_id))
        incoming.settle_at = time.monotonic() + self.rt.cfg.kv_timeout_s    # a READ in flight ends by then

    def report_transfer(self, incoming: Incoming) -> float | None:
        return ms(incoming.transfer_s) if incoming.failure is None else None    # decode moved the bytes

    def _renew_queued(self, now: float) -> None:
        """Still queued for blocks: keep the prefill's lease alive."""
        for incoming in self.rt.table.entries(Incoming):
            if incoming.side is self and incoming.reserved_at is None and \
                    now - (incoming.renewed_at or incoming.arrival) > self.rt.cfg.lease_s / 3:
                incoming.renewed_at = now
                self.rt.notify(incoming.peer, M.Renew(handoff_id=incoming.handoff_id))
