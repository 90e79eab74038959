"""One worker's handoff: the protocol ends it runs (pull.py, push.py, layerwise.py, reuse.py) behind
the engine's fixed hooks (engine/kv_connector.py) and behind the HTTP side (handoff.py).

Engine hooks go to the side that tracks the request (Runtime.requests); requests from the router
go to the side of their mode and role. Nothing here compares a mode: a Mode says which family it is.
"""
from __future__ import annotations

from kvhandoff.engine.kv_connector import KVConnector, KVEvents
from kvhandoff.engine.loop import EngineLoop
from kvhandoff.transfer.agent import TransferAgent
from kvhandoff.wire import messages as M
from kvhandoff.wire.modes import Mode
from kvhandoff.worker.config import HandoffConfig
from kvhandoff.worker.layerwise import LayerwisePrefill
from kvhandoff.worker.pull import PullDecode, PullPin, PullPrefill
from kvhandoff.worker.push import PushDecode, PushJob
from kvhandoff.worker.reuse import Retention, ReusePrefill
from kvhandoff.worker.runtime import Incoming, Runtime


class Connector(KVConnector):
    def __init__(self, loop: EngineLoop, agent: TransferAgent, cfg: HandoffConfig, worker_name: str):
        self.cfg = cfg
        self.rt = rt = Runtime(loop, agent, cfg, worker_name)
        self.reuse = ReusePrefill(rt, cfg.reuse, cfg.bidirectional)
        self.pull_prefill, self.push_prefill = PullPrefill(rt, self.reuse), LayerwisePrefill(rt, self.reuse)
        self.pull_decode, self.push_decode = PullDecode(rt), PushDecode(rt)
        self.retention = Retention(loop, cfg.retention, rt.layout.block_bytes) if cfg.bidirectional else None
        if self.retention is not None:
            self.retention.attach(rt)
            self.pull_decode.retention = self.push_decode.retention = self.retention
        rt.on(M.Cancel, None, lambda peer, note, entry: rt.table.end(note.handoff_id, "cancelled by the peer"))
        loop.engine.connect(self)

    def start(self) -> None:
        self.rt.start()

    def close(self) -> None:
        self.rt.close()

    @property
    def counters(self) -> dict[str, int]:
        return self.rt.counters.snapshot()

    # ---- the engine's hooks -----------------------------------------------------------------------
    def reserved(self, request, num_local_tokens: int) -> None:
        side, entry = self.rt.requests[request.request_id]
        side.reserved(entry, request, num_local_tokens)

    def finished(self, request, out) -> bool:
        side, entry = self.rt.requests.pop(request.request_id, (None, None))
        return side is not None and side.finished(entry, request, out)

    def start_loads(self) -> None:
        self.pull_decode.start_loads()
        self.push_decode.start_loads()

    def on_layer(self, layer: int, chunks) -> None:
        self.push_prefill.on_layer(layer, chunks)

    def poll(self) -> KVEvents:
        return self.rt.poll()

    def has_events(self) -> bool:
        return self.rt.has_events()

    # ---- what the router's requests reach ---------------------------------------------------------
    def prefill_side(self, mode: Mode):
        return self.pull_prefill if mode.is_pull else self.push_prefill

    def decode_side(self, mode: Mode):
        return self.pull_decode if mode.is_pull else self.push_decode

    def cancel(self, handoff_id: str) -> None:
        """Either role: the router gave up on this handoff (client gone, other leg refused): free what
        it holds, and refuse its request should that still arrive (a cancel can overtake it)."""
        entry = self.rt.table.get(handoff_id)
        if isinstance(entry, PullPin):
            self.pull_prefill.cancel(entry)
        elif isinstance(entry, PushJob):
            self.push_prefill.cancel(entry)
        elif isinstance(entry, Incoming):
            entry.side.cancel(entry)
        self.rt.table.end(handoff_id, "cancelled")
        self.rt.loop.abort(handoff_id)

    def kv_failed(self, report: M.KVFailed) -> bool:
        """Decode side: the router saw this handoff's push prefill fail. False if nothing waited."""
        entry = self.rt.table.get(report.handoff_id)
        if not isinstance(entry, Incoming):
            return False
        # Settled only when the prefill answered: a worker that answers has no WRITE left in flight
        # (it waits for its WRITE before answering); one that vanished mid-request might.
        return entry.side.fail_reported(entry, report.reason[:500], settled=report.prefill_answered,
                                        recompute=report.recompute)

