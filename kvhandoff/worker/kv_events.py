"""The worker's KV-event publisher: what its prefix cache and its retained conversations hold, as
vLLM-format events for every router (wire/kv_events.py has the format and the transport).

The engine thread produces the events (the block pool's, gathered while the engine is busy for up to
engine/loop.KV_EVENTS_EVERY_S, the retention's as it keeps and lets go, after the pool's before them:
plain tuples, since the engine knows nothing of the wire) and puts them on a queue; one
thread here turns them into batches, numbers them, sends them on the PUB socket, keeps the last
REPLAY_BUFFER for replay, and answers replay requests on the ROUTER socket. A snapshot (for a router
whose gap the buffer no longer covers) is taken on the engine thread, which first hands over every
event it has produced; it then goes through the queue like a batch, so its number is exactly the
last batch it includes.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import msgspec
import zmq

from kvhandoff.engine.block_pool import REMOVED, STORED
from kvhandoff.wire import kv_events as E
if TYPE_CHECKING:
    from kvhandoff.engine.loop import EngineLoop
    from kvhandoff.worker.reuse import Retention

log = logging.getLogger("kvhandoff.kv_events")
REPLAY_BUFFER = 10_000          # batches kept for replay (vLLM's buffer_steps)
REPLAY_MAX = 2_000              # a gap longer than this is answered with a snapshot (smaller than the churn)
TOPIC = b"kv-events"
RETAINED, UNRETAINED = "retained", "unretained"     # the retention's event kinds (worker/reuse.py)
CLEARED = "cleared"                                 # this worker holds nothing (it started, or a snapshot begins)


@dataclass
class SnapshotFor:
    """A replay request the buffer cannot answer: its snapshot, taken on the engine thread."""
    client: bytes
    events: list


def to_wire(events: list[tuple], block_size: int, medium: str) -> list:
    """The engine's event tuples as vLLM's events; a run of stored blocks that chain (one request's
    prompt) is one BlockStored, a run of removals one BlockRemoved."""
    out: list = []
    for kind, *rest in events:
        last = out[-1] if out else None
        if kind == STORED:
            h, parent, tokens = rest
            if (isinstance(last, E.BlockStored) and last.medium == medium and last.block_hashes[-1] == parent):
                last.block_hashes.append(h)
                last.token_ids.extend(tokens)
            else:
                out.append(E.BlockStored([h], parent, list(tokens), block_size, None, medium, None))
        elif kind == REMOVED:
            if isinstance(last, E.BlockRemoved) and last.medium == medium:
                last.block_hashes.append(rest[0])
            else:
                out.append(E.BlockRemoved([rest[0]], medium))
        elif kind == RETAINED:
            retention_id, session, hashes, tokens = rest
            out.append(E.BlockStored(list(hashes), None, list(tokens), block_size, None, E.MEDIUM_RETAINED, None,
                                     ownership=retention_id, session_id=session))
        elif kind == UNRETAINED:
            retention_id, hashes = rest
            out.append(E.BlockRemoved(list(hashes), E.MEDIUM_RETAINED, ownership=retention_id))
        else:
            assert kind == CLEARED, kind
            out.append(E.AllBlocksCleared())
    return out


class Publisher:
    """Owns the PUB and ROUTER sockets and the thread that serves them. `snapshot()` runs on the
    engine thread (through `call`) and returns everything held, as event tuples."""

    def __init__(self, secret: bytes, host: str, block_size: int, medium: str,
                 call: Callable[[Callable[[], object]], object], snapshot: Callable[[], list[tuple]],
                 drop_every: int = 0):
        self.block_size, self.medium, self.call, self.snapshot = block_size, medium, call, snapshot
        self.drop_every = drop_every            # fault injection (faults.py drop_events): every Nth batch is lost
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.replay = self.context.socket(zmq.ROUTER)
        for sock in (self.pub, self.replay):
            E.secure_server(sock, secret)
            sock.linger = 0
            sock.ipv6 = ":" in host
        self.pub.sndhwm = 100_000
        self.host = host
        address = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
        self.port = self.pub.bind_to_random_port(address)
        self.replay_port = self.replay.bind_to_random_port(address)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        # publish() wakes the thread through a pipe, which it polls with the replay socket: it sleeps
        # until there is something to do (or a heartbeat is due), never on a timer of its own.
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        self.next_seq = 0
        self.counters = {"batches": 0, "events": 0, "replays": 0, "snapshots": 0}
        self.running = True
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.publish([(CLEARED,)])            # a (re)started worker holds nothing: its first batch says so

    def start(self) -> None:
        self.thread.start()

    def publish(self, events: list[tuple]) -> None:
        """Any thread (in practice the engine's): events in the order they happened."""
        self.queue.put(events)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self.wake_write, b"\0")
        except BlockingIOError:             # the pipe is full: the thread has plenty of wake-ups to read
            pass

    def close(self) -> None:
        self.running = False
        self.queue.put(None)
        self._wake()
        if self.thread.is_alive():
            self.thread.join(2.0)
        self.context.destroy(linger=0)
        os.close(self.wake_read)
        os.close(self.wake_write)

    # ---- the publisher's thread -------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        poller.register(self.wake_read, zmq.POLLIN)
        last_sent = 0.0
        try:
            while self.running:
                due = last_sent + E.HEARTBEAT_S - time.monotonic()
                ready = dict(poller.poll(max(0.0, due) * 1000))
                if self.replay in ready:
                    while self.replay.poll(0):
                        self._replay_request(self.replay.recv_multipart())
                if self.wake_read in ready:
                    try:
                        os.read(self.wake_read, 65536)
                    except BlockingIOError:
                        pass
                sent = self._drain()
                if sent is None:
                    break
                if sent or time.monotonic() - last_sent >= E.HEARTBEAT_S:
                    if not sent:
                        self._heartbeat()       # alive, nothing happened
                    last_sent = time.monotonic()
        except zmq.ZMQError as exc:
            if self.running:
                log.error("KV-event publisher stopped: %s", exc)

    def _drain(self) -> bool | None:
        """Send what is queued, as few batches as a snapshot's place allows; None once told to stop."""
        events: list[tuple] = []
        sent = False
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return None
            if isinstance(item, SnapshotFor):
                if events:
                    self._send(to_wire(events, self.block_size, self.medium))
                    events, sent = [], True
                self._answer_snapshot(item)
                continue
            events.extend(item)
        if events:
            self._send(to_wire(events, self.block_size, self.medium))
            sent = True
        return sent

    def _send(self, events: list) -> None:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        payload = E.encoder.encode(E.KVEventBatch(time.time(), events))
        if self.drop_every and seq and seq % self.drop_every == 0:
            log.warning("fault injection: KV-event batch %d not sent (it can be replayed)", seq)
        else:
            self.pub.send_multipart((TOPIC, E.seq_bytes(seq), payload))
        self.buffer.append((seq, payload))
        self.counters["batches"] += 1
        self.counters["events"] += len(events)

    def _heartbeat(self) -> None:
        """Alive, nothing happened: an empty batch under the last batch's number (not buffered), which
        also shows a subscriber that missed that batch its gap."""
        payload = E.encoder.encode(E.KVEventBatch(time.time(), []))
        self.pub.send_multipart((TOPIC, E.seq_bytes(self.next_seq - 1), payload))

    def _replay_request(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
        oldest = self.buffer[0][0] if self.buffer else self.next_seq
        if oldest <= start and self.next_seq - start <= REPLAY_MAX:
            self.counters["replays"] += 1
            for seq, payload in self.buffer:
                if seq >= start:
                    self.replay.send_multipart((client, b"", TOPIC, E.seq_bytes(seq), payload))
            self.replay.send_multipart((client, b"", b"", E.END_SEQ, b""))
            return
        # Taken on the engine thread, after it hands over the events it holds back: it arrives in the
        # queue behind every event it reflects, before any it does not.
        def take() -> None:
            self.queue.put(SnapshotFor(client, [(CLEARED,), *self.snapshot()]))
            self._wake()
        self.call(take)

    def _answer_snapshot(self, item: SnapshotFor) -> None:
        self.counters["snapshots"] += 1
        payload = E.encoder.encode(E.KVEventBatch(time.time(), to_wire(item.events, self.block_size, self.medium)))
        self.replay.send_multipart((item.client, b"", TOPIC, E.seq_bytes(self.next_seq - 1), payload))
        self.replay.send_multipart((item.client, b"", b"", E.END_SEQ, b""))

    def health(self, retention_ttl_s: float | None, tokenizer: str) -> dict:
        """/health's `kv_events`: where to subscribe and how to read it, and what was sent so far."""
        about = E.Health(self.host, self.port, self.replay_port, self.block_size, retention_ttl_s=retention_ttl_s,
                         tokenizer=tokenizer)
        return msgspec.structs.asdict(about) | self.counters | {"seq": self.next_seq - 1}


def attach(loop: EngineLoop, retention: Retention | None, secret: bytes, host: str, drop_every: int = 0) -> Publisher:
    """A publisher for this worker's engine (and retention, on a bidirectional decode worker), wired
    before the engine loop starts."""
    pool = loop.engine.pool

    def snapshot() -> list[tuple]:              # engine thread
        loop.flush_kv_events()
        return pool.snapshot() + (retention.snapshot() if retention is not None else [])

    def retained(events: list[tuple]) -> None:  # engine thread: after the pool's, which the loop may hold
        loop.flush_kv_events()
        publisher.publish(events)
    publisher = Publisher(secret, host, pool.block_size, "CPU", loop.call, snapshot, drop_every)
    loop.on_kv_events = publisher.publish
    if retention is not None:
        retention.publish = retained
    return publisher
