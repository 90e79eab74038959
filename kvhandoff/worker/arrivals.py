"""K/V that comes from another worker, driven (protocol/arrival.py decides): the decode side of pull
and push, and a prefill's reverse read of retained history (reuse.py). One Incoming per handoff;
`Arrivals` turns what happens to it (blocks reserved, bytes in, a failure, the request's end, a
peer's death, a timer) into the machine's events and carries the actions out; `DecodeSide` is what
pull's and push's decode ends share (the request queued for its K/V, its final report).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvhandoff.engine.holds import set_aside_owner
from kvhandoff.engine.request import RequestOutput, SamplingParams
from kvhandoff.wire import messages as M
from kvhandoff.worker.config import HandoffConfig
from kvhandoff.worker.engine_door import EngineDoor
from kvhandoff.worker.errors import HandoffError
from kvhandoff.worker.faults import KILL_AFTER_TOKENS, KILL_DELAY_S
from kvhandoff.worker.inflight import Counters, InFlight
from kvhandoff.worker.kv_layout import KVLayout
from kvhandoff.worker.mailbox import Mailbox
from kvhandoff.worker.peers import Peers
from kvhandoff.worker.protocol import arrival as A
from kvhandoff.worker.protocol.actions import Count, End, Notify, Warn

log = logging.getLogger("kvhandoff.handoff")


@dataclass(eq=False)
class Incoming:
    """One handoff's K/V on its way here: where it comes from, the blocks it lands in, what was measured,
    and its state (protocol/arrival.py), changed only under `lock`."""
    handoff_id: str                     # its key in the table of handoffs in flight
    num_kv_tokens: int
    request_id: str = ""                # the engine request it is for (default: handoff_id)
    side: object = None                 # the protocol end that owns it (post_read / register)
    peer: str | None = None
    mode: M.Mode | None = None
    remote_blocks: list[int] = field(default_factory=list)     # pull, fetch: known up front
    remote_layout: KVLayout | None = None                      # ... in the peer's pool, of this layout
    checksums: list[int] | None = None                         # pull, fetch: up front; push: with Done
    first_token: int | None = None                             # sampled by the prefill
    skip_blocks: int = 0        # leading blocks this worker holds already (its prefix cache): not moved
    block_ids: list[int] = field(default_factory=list)
    transfer_started: float | None = None
    transfer_s: float = 0.0
    ready_at: float | None = None
    bytes: int = 0
    expects_first_token: bool = True    # a whole prompt's K/V comes with the token the prefill sampled
    kind: A.Kind = A.Kind.PULL
    recompute: bool = True              # the failure policy
    extra: dict = field(default_factory=dict)       # what the owning side keeps (retain, supersedes, lease)
    state: A.Arrival | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        self.request_id = self.request_id or self.handoff_id
        if self.state is None:
            self.state = A.Arrival(self.handoff_id, self.kind, time.monotonic(), self.peer, self.recompute)

    @property
    def arrival(self) -> float:
        return self.state.arrival

    @property
    def reserved_at(self) -> float | None:
        return self.state.reserved_at

    @property
    def failure(self) -> str | None:
        return self.state.failure

    @property
    def transferred_blocks(self) -> list[int]:
        """Our blocks the K/V travels into (those after the ones we had already)."""
        return self.block_ids[self.skip_blocks:]


class Arrivals:
    def __init__(self, door: EngineDoor, table: InFlight, mail: Mailbox, counters: Counters, cfg: HandoffConfig):
        self.door, self.table, self.mail, self.counters, self.cfg = door, table, mail, counters, cfg

    def step(self, incoming: Incoming, event) -> list:
        """Feed the machine one event and carry its actions out, all under the Incoming's lock."""
        with incoming.lock:
            was_aside = incoming.state.aside
            incoming.state, actions = A.step(incoming.state, event)
            if incoming.state.aside and not was_aside:
                self.table.put_aside(incoming.request_id, incoming)
            for action in actions:
                self._do(incoming, action)
        return actions

    def _do(self, incoming: Incoming, action) -> None:
        kind = type(action)
        if kind is End:
            self.table.claim(incoming.handoff_id, action.reason, incoming, action.status)
        elif kind is A.Lost:
            self.door.lost(incoming.request_id, action.recompute, action.reason, action.settled)
        elif kind is A.Landed:
            incoming.ready_at = time.monotonic()
            self.door.landed(incoming.request_id, action.first_token)
        elif kind is Count:
            self.counters.bump(action.name)
            if action.name == "handoffs":
                self.counters.bump("bytes", incoming.bytes)
        elif kind is Notify:
            self.mail.notify(action.peer, action.note)
        elif kind is A.ReleaseAside:
            self.table.take_aside(incoming.request_id)
            self.door.release(set_aside_owner(incoming.request_id))
        elif kind is Warn:
            log.warning("%s", action.message)
        elif kind is A.PostRead:
            incoming.side.post_read(incoming)
        elif kind is A.Register:
            incoming.side.register(incoming)
        else:
            raise AssertionError(f"no driver for {action!r}")

    # ---- what happens to an Incoming ---------------------------------------------------------------
    def reserved(self, incoming: Incoming, request, num_local_tokens: int) -> None:
        """Engine thread: its blocks are reserved (those the prefix cache held need not travel)."""
        incoming.block_ids = list(request.block_table)
        incoming.skip_blocks = num_local_tokens // self.door.block_size
        if incoming.kind is not A.Kind.PUSH:
            skip = incoming.skip_blocks
            incoming.remote_blocks, incoming.checksums = incoming.remote_blocks[skip:], incoming.checksums[skip:]
        self.step(incoming, A.Reserved(time.monotonic(), self.cfg.kv_timeout_s))

    def arrived(self, incoming: Incoming) -> None:
        """The bytes are in our blocks: verify them, then let the engine use them (or recompute)."""
        if incoming.expects_first_token and not self.door.is_token(incoming.first_token):
            self.step(incoming, A.Arrived(None, f"the prefill sent no valid first token ({incoming.first_token!r})"))
            return
        started = time.monotonic()
        if self.cfg.faults.verify_ms:
            time.sleep(self.cfg.faults.verify_ms / 1000)
        got = self.door.checksums(incoming.transferred_blocks)
        incoming.transfer_s += time.monotonic() - started       # verification is part of the transfer
        problem = None
        if got != incoming.checksums:
            self.counters.bump("verify_failures")
            bad = sum(a != b for a, b in zip(got, incoming.checksums or []))
            problem = f"KV failed verification ({bad} of {len(got)} blocks differ; the lease may have expired)"
        self.step(incoming, A.Arrived(incoming.first_token, problem))

    def fail(self, incoming: Incoming, reason: str, settled: bool = True, recompute: bool | None = None) -> bool:
        """The K/V of this handoff will not come (or came wrong): recompute or fail by policy (or as
        `recompute` says). `settled=False`: a transfer into its blocks may still be under way, so
        they stay aside until the settle time, a late Done/Failed, or the peer's death. False if
        another outcome had already decided it."""
        actions = self.step(incoming, A.Failed(time.monotonic(), reason, recompute, settled, 2 * self.cfg.kv_timeout_s))
        return bool(actions)

    def ended(self, incoming: Incoming, reason: str) -> bool:
        """The engine ended the request: True if that ended the handoff (its K/V had not landed)."""
        return bool(self.step(incoming, A.RequestEnded(time.monotonic(), reason, self.cfg.kv_timeout_s)))

    def settle(self, request_id: str) -> bool:
        """No transfer can touch this request's set-aside blocks any more: free them."""
        incoming = self.table.aside(request_id)
        return incoming is not None and bool(self.step(incoming, A.Settle()))

    def tick(self, now: float) -> None:
        """The housekeeper: each kind's timers, and set-aside blocks whose settle time has come."""
        for incoming in self.table.entries(Incoming):
            self.step(incoming, A.Tick(now, self.cfg.kv_timeout_s, self.cfg.lease_s))
        for incoming in self.table.all_aside():
            if now >= (incoming.state.settle_at or 0):
                self.settle(incoming.request_id)

    def peer_lost(self, peer: str, reason: str) -> None:
        """A peer's agent died: every handoff with it ends now, not at its deadline; a dead writer
        writes no more, so blocks set aside for it go back."""
        for incoming in self.table.entries(Incoming):
            if incoming.peer == peer:
                self.fail(incoming, f"prefill worker's agent {peer!r} is gone ({reason})" if incoming.kind
                          is not A.Kind.FETCH else f"decode worker's agent {peer!r} is gone ({reason})")
        for incoming in self.table.all_aside():
            if incoming.peer == peer:
                self.settle(incoming.request_id)


class DecodeSide:
    """What the decode ends of pull and push share: the request queued for its K/V, the report on its
    final output, retention (bidirectional), and the ends every handoff can meet on this side: the
    router's /kv/failed and /kv/cancel, the request ending first."""
    kind: A.Kind

    def __init__(self, door: EngineDoor, table: InFlight, arrivals: Arrivals, peers: Peers, cfg: HandoffConfig,
                 worker_name: str, retention=None):
        self.door, self.table, self.arrivals, self.peers, self.cfg = door, table, arrivals, peers, cfg
        self.worker_name = worker_name
        self.retention = retention          # reuse.Retention, with --bidirectional

    def incoming(self, kv, num_tokens: int, peer: str, **fields) -> Incoming:
        return Incoming(kv.handoff_id, num_tokens, side=self, peer=peer, mode=kv.mode, kind=self.kind,
                        recompute=self.cfg.recompute, **fields)

    def submit(self, kv, incoming: Incoming, prompt_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None]) -> None:
        incoming.side = self
        incoming.extra["supersedes"], incoming.extra["session"] = kv.supersedes, kv.session
        self.table.add(kv.handoff_id, incoming)
        faults = self.cfg.faults

        def with_faults(out: RequestOutput) -> None:       # engine thread
            if out.num_output_tokens >= KILL_AFTER_TOKENS:
                faults.reached("decode", kv.handoff_id, delay_s=KILL_DELAY_S)
            on_output(out)
        try:
            self.door.submit(self, incoming, kv.handoff_id, prompt_ids, params,
                             with_faults if faults.kill_at == "decode" else on_output,
                             remote_tokens=len(prompt_ids), retain=kv.retain and self.retention is not None)
        except ValueError as exc:
            self.table.claim(kv.handoff_id, str(exc), incoming)
            raise HandoffError(str(exc), 400) from None

    def reserved(self, incoming: Incoming, request, num_local_tokens: int) -> None:
        """Engine thread, scheduler half: blocks are reserved; the machine says what goes out."""
        self.arrivals.reserved(incoming, request, num_local_tokens)

    def finished(self, incoming: Incoming, request, out: RequestOutput) -> bool:
        """Engine thread: annotate the final output with the handoff's report. A request that ended
        before its K/V landed (the client left) ends its handoff too."""
        self.arrivals.ended(incoming, out.finish_reason)
        out.handoff = self.report(incoming, out)
        if out.retained is not None and self.retention is not None:     # (a failed turn keeps the previous one)
            out.handoff["retained"] = self.retention.on_retained(out.retained, incoming.extra["supersedes"],
                                                                  incoming.extra["session"])
        return False

    def report_transfer(self, incoming: Incoming) -> float | None:
        """The transfer phase as this side measured it (None: the other side measures it)."""
        return None

    def report(self, incoming: Incoming, out: RequestOutput) -> dict:
        t = out.timings or {}
        phases: dict = {}
        if incoming.reserved_at is not None:
            phases["handoff_wait"] = M.ms(incoming.reserved_at - incoming.arrival)
        if (transfer := self.report_transfer(incoming)) is not None:
            phases["transfer"] = transfer
        if incoming.ready_at is not None:
            phases["decode_queue"] = t.get("decode_queue_ms")
            phases["first_step"] = t.get("first_step_ms")       # the decode's first step makes the 2nd token
        report = M.DecodeReport(
            handoff_id=incoming.handoff_id, mode=incoming.mode, decode_worker=self.worker_name,
            bytes_transferred=incoming.bytes, blocks=len(incoming.transferred_blocks),
            decode_cached_tokens=incoming.skip_blocks * self.door.block_size,
            kv_source="remote" if incoming.failure is None else "recomputed", phases_ms=phases, error=incoming.failure)
        return report.to_dict()

    def fail_reported(self, incoming: Incoming, reason: str, settled: bool, recompute: bool | None) -> bool:
        """The router saw the prefill leg fail (/kv/failed)."""
        return self.arrivals.fail(incoming, f"router reported: {reason}", settled=settled, recompute=recompute)

    def cancel(self, incoming: Incoming) -> None:
        """The router gave up on the request: end it (its stream is closed too); finished() does the rest."""
        self.door.abort(incoming.request_id)

    def start_loads(self) -> None:
        """Engine thread, once per step: post what this step's reservations recorded."""
