"""One `kvhandoff serve` process, assembled for its role in one place (docs/STRUCTURE.md).

- colocated (`--role both`): engine, engine loop, the OpenAI server. No agent, no handoff.
- prefill: the same, with a transfer agent owning the KV pool, the handoff's parts (engine door,
  table of handoffs, mailbox, peers, chores) and the prefill sides only: pull (pin under a lease),
  push and push-layerwise (the writer; layer-wise WRITEs from the engine's per-layer hook), and with
  --bidirectional the reverse read of retained history.
- decode: the parts, and the decode sides only: pull (READ), push (register, wait for Done), and with
  --bidirectional retention of finished turns.
Either disaggregated role publishes what it holds as KV events unless --no-kv-events.

Everything is built before anything runs; `start` starts the threads (the handoff's, then the
publisher's, then the engine loop's), `close` stops them and unlinks the KV pool.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from fastapi import FastAPI

from kvhandoff.config import EngineConfig
from kvhandoff.engine.engine import LLMEngine
from kvhandoff.engine.loop import EngineLoop
from kvhandoff.transfer.agent import WILDCARD_HOSTS, TransferAgent
from kvhandoff.wire import messages as M
from kvhandoff.wire.modes import Role
from kvhandoff.worker.arrivals import Arrivals, Incoming
from kvhandoff.worker.chores import Chores
from kvhandoff.worker.config import HandoffConfig
from kvhandoff.worker.connector import Connector
from kvhandoff.worker.control import HTTPControl
from kvhandoff.worker.engine_door import EngineDoor
from kvhandoff.worker.inflight import Counters, InFlight
from kvhandoff.worker.layerwise import LayerwisePrefill
from kvhandoff.worker.mailbox import Mailbox
from kvhandoff.worker.metrics import Metrics
from kvhandoff.worker.peers import Peers
from kvhandoff.worker.pull import PullDecode, PullPin, PullPrefill
from kvhandoff.worker.push import PushDecode, PushJob
from kvhandoff.worker.reuse import Retention, ReusePrefill
from kvhandoff.worker.server import EngineInfo, build_app
from kvhandoff.worker.sides import DecodeSides, PrefillSides

log = logging.getLogger("kvhandoff.worker")


@dataclass
class WorkerConfig:
    role: Role
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    secret: bytes | None = None         # the deployment secret: required for a disaggregated role
    kv_host: str | None = None          # where the KV agent (and the event publisher) listen: host's by default
    kv_backend: str = "auto"
    kv_shm_dir: str | None = None
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    kv_events: bool = True
    max_in_flight: int | None = None
    queue_wait_s: float = 10.0
    model_alias: str | None = None      # another name requests may use for the model

    @property
    def worker_name(self) -> str:
        return f"{self.role}-{self.port}-{os.getpid()}"


class WorkerSetupError(Exception):
    """The worker cannot start as configured; the message says what to change."""


@dataclass
class Worker:
    """A built worker: its HTTP app, its engine loop, and what runs beside them."""
    app: FastAPI
    loop: EngineLoop
    parts: list = field(default_factory=list)      # what starts before the engine loop and stops after it
    agent: object = None                           # the transfer agent: closed last (it owns the KV pool)

    def start(self) -> None:
        # Ready means serving at full speed: the pool's pages, committed while the worker was built,
        # are all in before the first request (a 512 MiB pool: 0.4-1.7 s on a 2-core VM, most of it
        # beside the rest of the start).
        self.loop.engine.runner.wait_populated()
        for part in self.parts:
            part.start()
        self.loop.start()

    def close(self) -> None:
        self.loop.stop()
        for part in self.parts:
            part.close()
        if self.agent is not None:
            self.agent.close()       # unlinks the shared-memory KV pool


def build_worker(config: WorkerConfig) -> Worker:
    if config.role == Role.BOTH:
        engine = _engine(config.engine, None)
        loop = _loop(engine, config)
        return Worker(build_app(loop, EngineInfo.from_engine(engine, alias=config.model_alias),
                                config.max_in_flight, config.queue_wait_s), loop)
    if not config.secret:
        raise WorkerSetupError(f"--role {config.role} needs the deployment secret")
    listen = config.kv_host or config.host
    if listen in WILDCARD_HOSTS:
        raise WorkerSetupError(f"the KV agent would listen on {listen} and could not tell its peers where to "
                               "connect: pass --kv-host ADDRESS, this machine's address as the other workers see it")
    agent = TransferAgent(config.worker_name, config.secret, backend=config.kv_backend, listen_host=listen,
                          shm_dir=config.kv_shm_dir, protocol=M.PROTOCOL)
    try:
        engine = _engine(config.engine, lambda nbytes: agent.allocate_region("kv", nbytes))
        loop = _loop(engine, config)
        return _handoff_worker(config, agent, engine, loop)
    except BaseException:
        agent.close()
        raise


def _engine(config: EngineConfig, kv_allocator) -> LLMEngine:
    from kvhandoff.model.paired_kv import OddBlockSize
    from kvhandoff.transfer.memory import NoRoom
    try:
        return LLMEngine(config, kv_allocator=kv_allocator)
    except NoRoom as e:
        raise WorkerSetupError(e.strerror) from None
    except OddBlockSize as e:
        raise WorkerSetupError(str(e)) from None


def _loop(engine: LLMEngine, config: WorkerConfig) -> EngineLoop:
    loop = EngineLoop(engine)
    faults = config.handoff.faults
    loop.step_delay_s, loop.fail_steps = faults.step_ms / 1000, faults.engine_fail
    return loop


@dataclass
class Handoff:
    """A prefill or decode worker's handoff, assembled: the parts every side is given what it needs of
    (the engine door, the table of handoffs in flight, the mailbox, the peers, the chores), and the
    sides of its role. The HTTP side (handoff.py) and tests reach the sides through it; no side does."""
    role: Role
    worker_name: str
    cfg: HandoffConfig
    door: EngineDoor
    table: InFlight
    counters: Counters
    chores: Chores
    mail: Mailbox
    peers: Peers
    arrivals: Arrivals
    control: HTTPControl
    prefill: PrefillSides | None = None
    decode: DecodeSides | None = None

    @property
    def retention(self) -> Retention | None:
        return self.decode.retention if self.decode is not None else None

    @property
    def reuse(self) -> ReusePrefill | None:
        return self.prefill.reuse if self.prefill is not None else None

    def start(self) -> None:
        """Start the threads: every side has registered its handlers and timers by now."""
        self.peers.start()
        self.chores.start()
        self.mail.start()

    def close(self) -> None:
        self.chores.close()
        self.mail.close()

    def cancel(self, handoff_id: str) -> None:
        """Either role: the router gave up on this handoff (client gone, other leg refused): free what
        it holds, and refuse its request should that still arrive (a cancel can overtake it)."""
        entry = self.table.get(handoff_id)
        if isinstance(entry, PullPin):
            self.prefill.pull.cancel(entry)
        elif isinstance(entry, PushJob):
            self.prefill.push.cancel(entry)
        elif isinstance(entry, Incoming):
            entry.side.cancel(entry)
        self.table.end(handoff_id, "cancelled")
        self.door.abort(handoff_id)

    def kv_failed(self, report: M.KVFailed) -> bool:
        """Decode side: the router saw this handoff's push prefill fail. False if nothing waited."""
        entry = self.table.get(report.handoff_id)
        if not isinstance(entry, Incoming):
            return False
        # Settled only when the prefill answered: a worker that answers has no WRITE left in flight
        # (it waits for its WRITE before answering); one that vanished mid-request might.
        return entry.side.fail_reported(entry, report.reason[:500], settled=report.prefill_answered,
                                        recompute=report.recompute)


def build_handoff(role: Role, cfg: HandoffConfig, worker_name: str, agent: TransferAgent, loop: EngineLoop,
                  secret: bytes) -> Handoff:
    """The handoff's parts and the sides of `role`, connected to the engine's hooks (nothing started)."""
    door, table, counters, chores = EngineDoor(loop), InFlight(4 * cfg.kv_timeout_s), Counters(), Chores()
    mail, peers = Mailbox(agent, table, counters, cfg.faults), Peers(agent, chores)
    arrivals = Arrivals(door, table, mail, counters, cfg)
    handoff = Handoff(role, worker_name, cfg, door, table, counters, chores, mail, peers, arrivals, HTTPControl(secret))
    chores.every_tick(table.sweep)
    chores.every_tick(arrivals.tick)
    peers.on_lost(arrivals.peer_lost)
    # A cancel that overtook its handoff's request: refuse the request should it still come.
    mail.on(M.Cancel, None, lambda peer, note, entry: table.end(note.handoff_id, "cancelled by the peer"))
    common = dict(door=door, table=table, arrivals=arrivals, peers=peers, cfg=cfg, worker_name=worker_name)
    if role == Role.PREFILL:
        reuse = ReusePrefill(door=door, arrivals=arrivals, peers=peers, chores=chores, mail=mail,
                             control=handoff.control, cfg=cfg) if cfg.bidirectional else None
        parts = dict(common, chores=chores, counters=counters, mail=mail, reuse=reuse)
        handoff.prefill = PrefillSides(PullPrefill(**parts), LayerwisePrefill(**parts), reuse)
        connector = Connector(door, [], layers=handoff.prefill.push)
    else:
        assert role == Role.DECODE, role
        retention = None
        if cfg.bidirectional:
            retention = Retention(loop, cfg.retention, door.layout.block_bytes)
            retention.attach(mail, chores)
        handoff.decode = DecodeSides(
            PullDecode(chores=chores, mail=mail, retention=retention, **common),
            PushDecode(mail=mail, control=handoff.control, counters=counters, retention=retention, **common),
            retention)
        connector = Connector(door, [handoff.decode.pull, handoff.decode.push])
    loop.engine.connect(connector)
    return handoff


def _handoff_worker(config: WorkerConfig, agent, engine: LLMEngine, loop: EngineLoop) -> Worker:
    """A prefill or decode worker: its handoff, its KV events, its HTTP routes."""
    from kvhandoff.worker.handoff import WorkerHandoff, attach_worker_routes
    handoff = build_handoff(config.role, config.handoff, config.worker_name, agent, loop, config.secret)
    publisher = None
    if config.kv_events:
        from kvhandoff.worker.kv_events import attach
        publisher = attach(loop, handoff.retention, config.secret, config.kv_host or config.host,
                           config.handoff.faults.drop_events)
    metrics = Metrics()
    info = EngineInfo.from_engine(engine, alias=config.model_alias)
    http = WorkerHandoff(handoff, config.secret, metrics, info, publisher)
    app = build_app(loop, info, config.max_in_flight, config.queue_wait_s, handoff=http, metrics=metrics)
    attach_worker_routes(app, http, app.state.server)
    return Worker(app, loop, [handoff] + ([publisher] if publisher is not None else []), agent)
