"""The router's subscriptions to its workers' KV events (wire/kv_events.py), which keep its index
(kv_index.py) and session map current without a request ever waiting on them.

One feed per worker that publishes (its /health names the ports): a SUB socket for the live batches
and, to start and after a gap, a replay request on the worker's ROUTER socket (missed batches, or a
snapshot when its buffer no longer reaches back). Sequence numbers tell a gap (a batch lost or a
subscriber too slow for its high-water mark) and a restart (a worker restarted at the same URL binds
new ports: its next /health starts a new feed). A feed is `fresh` while synchronised and heard from
within STALE_S (batches or heartbeats); a worker whose feed is not fresh is asked on the request's
path instead (prefix.py, sessions.py), and /health and /metrics say so.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from kvhandoff.router.kv_index import KVIndex
from kvhandoff.wire import kv_events as E

log = logging.getLogger("kvhandoff.router")
REPLAY_TIMEOUT_S = 5.0
FRESH_CACHE_S = 0.1


@dataclass
class Feed:
    url: str
    info: E.Health
    synced: bool = False
    last_seq: int = -1
    last_heard: float = 0.0
    task: asyncio.Task | None = None
    resyncing: asyncio.Task | None = None       # a replay after a gap, while live batches wait
    counters: dict = field(default_factory=lambda: {"batches": 0, "gaps": 0, "resyncs": 0, "resync_ms": 0.0})

    def fresh(self, now: float) -> bool:
        return self.synced and now - self.last_heard < E.STALE_S

    def endpoint(self, port: int) -> str:
        host = self.info.host if self.info.host not in ("0.0.0.0", "::", "*") else urlsplit(self.url).hostname
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Feeds:
    def __init__(self, index: KVIndex, secret: bytes):
        self.index, self.secret = index, secret
        self.context = zmq.asyncio.Context()          # replay requests (DEALER)
        self.live_context = zmq.Context()              # live batches (SUB, read by a loop reader callback)
        self.feeds: dict[str, Feed] = {}
        self.fresh_set: frozenset[str] = frozenset()
        self.fresh_at = float("-inf")

    def update(self, url: str, health: dict | None) -> None:
        """After each /health poll of a worker: follow its events, or again where it restarted."""
        raw = (health or {}).get("kv_events")
        try:
            info = msgspec.convert(raw, E.Health) if isinstance(raw, dict) else None
        except msgspec.ValidationError as e:
            log.warning("%s: its kv_events in /health are not understood (%s): it is asked instead", url, e)
            info = None
        feed = self.feeds.get(url)
        if feed is not None and info is not None and (feed.info.host, feed.info.port, feed.info.replay_port) == \
                (info.host, info.port, info.replay_port):
            feed.info = info
            return
        self.stop(url)
        if info is not None:
            feed = self.feeds[url] = Feed(url, info)
            feed.task = asyncio.ensure_future(self.follow(feed))

    def stop(self, url: str) -> None:
        """The worker left (or restarted): its feed ends and what it held is forgotten."""
        feed = self.feeds.pop(url, None)
        if feed is not None:
            self.fresh_at = float("-inf")           # (fresh_urls() named it: not any more)
            for task in (feed.task, feed.resyncing):
                if task is not None:
                    task.cancel()
            self.index.forget(url)

    def close(self) -> None:
        for url in list(self.feeds):
            self.stop(url)
        self.context.destroy(linger=0)
        self.live_context.destroy(linger=0)

    def fresh(self, url: str, now: float | None = None) -> bool:
        feed = self.feeds.get(url)
        return feed is not None and feed.fresh(time.monotonic() if now is None else now)

    def fresh_urls(self) -> frozenset[str]:
        """The workers whose events are fresh, as of at most FRESH_CACHE_S ago: read on every request,
        so not rebuilt for each (a feed goes stale over seconds, not within this)."""
        now = time.monotonic()
        if now - self.fresh_at > FRESH_CACHE_S:
            self.fresh_set = frozenset(url for url, feed in self.feeds.items() if feed.fresh(now))
            self.fresh_at = now
        return self.fresh_set

    def status(self) -> dict:
        now = time.monotonic()
        return {url: {"fresh": feed.fresh(now), "seq": feed.last_seq, "heard_s_ago": round(now - feed.last_heard, 3)
                      if feed.last_heard else None, **feed.counters} for url, feed in self.feeds.items()}

    # ---- one feed ------------------------------------------------------------------------------
    async def follow(self, feed: Feed) -> None:
        """Synchronise, then read live batches as they come (a reader callback on the SUB socket: one
        wake-up drains every batch waiting, with no future per batch), until cancelled."""
        sub = self.live_context.socket(zmq.SUB)
        E.secure_client(sub, self.secret)
        sub.linger = 0
        sub.ipv6 = True
        sub.rcvhwm = 100_000
        sub.subscribe(b"")
        sub.connect(feed.endpoint(feed.info.port))
        loop = asyncio.get_running_loop()
        fd = sub.getsockopt(zmq.FD)
        try:
            while not feed.synced:              # (live batches wait in the socket meanwhile)
                await self.resync(feed)
                if not feed.synced:
                    await asyncio.sleep(1.0)
            loop.add_reader(fd, self.readable, feed, sub)
            self.readable(feed, sub)            # (the FD is edge-triggered: what came before counts too)
            await asyncio.Event().wait()
        finally:
            try:
                loop.remove_reader(fd)
            except (OSError, ValueError):       # (the router is closing: its context took the socket)
                pass
            sub.close(linger=0)

    def readable(self, feed: Feed, sub: zmq.Socket) -> None:
        while feed.resyncing is None and sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                _, raw_seq, payload = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.live(feed, int.from_bytes(raw_seq, "big", signed=True), payload, sub)
            except Exception:                   # a bug here must not end the router's other work
                log.exception("%s: a KV-event batch failed; resynchronising", feed.url)
                self.start_resync(feed, sub)

    def live(self, feed: Feed, seq: int, payload: bytes, sub: zmq.Socket | None = None) -> None:
        feed.last_heard = time.monotonic()
        if seq <= feed.last_seq:
            return                              # a heartbeat, or what the replay already applied
        started = time.perf_counter_ns()
        batch = self.decode(feed, seq, payload)
        # A heartbeat (empty) names the last batch sent: past ours, it is one we never got.
        if batch is None or seq != feed.last_seq + 1 or not batch.events:
            feed.counters["gaps"] += 1
            log.info("%s: KV events %d..%d missed: replaying", feed.url, feed.last_seq + 1, seq)
            self.start_resync(feed, sub)
            return
        self.apply(feed, seq, batch)
        self.index.apply_ns += time.perf_counter_ns() - started

    def start_resync(self, feed: Feed, sub: zmq.Socket | None) -> None:
        """Replay what is missing, then go on reading (what came meanwhile waits in the socket)."""
        if feed.resyncing is not None:
            return

        async def run() -> None:
            try:
                await self.resync(feed)
            finally:
                feed.resyncing = None
            if sub is not None and not sub.closed:
                self.readable(feed, sub)
        feed.resyncing = asyncio.ensure_future(run())

    def decode(self, feed: Feed, seq: int, payload: bytes) -> E.KVEventBatch | None:
        try:
            return E.decoder.decode(payload)
        except msgspec.DecodeError as e:
            log.warning("%s: KV-event batch %d unreadable (%s): resynchronising", feed.url, seq, e)
            feed.synced = False
            return None

    def apply(self, feed: Feed, seq: int, batch: E.KVEventBatch) -> None:
        self.index.apply(feed.url, batch, feed.info.retention_ttl_s, feed.info.hash_scheme == E.HASH_SCHEME)
        feed.last_seq = seq
        feed.counters["batches"] += 1

    async def resync(self, feed: Feed) -> None:
        """Ask the worker's replay socket for everything after the last batch applied (a snapshot if
        its buffer does not reach back that far) and apply it."""
        started = time.perf_counter()
        dealer = self.context.socket(zmq.DEALER)
        E.secure_client(dealer, self.secret)
        dealer.linger = 0
        dealer.ipv6 = True
        dealer.connect(feed.endpoint(feed.info.replay_port))
        try:
            await dealer.send_multipart([b"", E.seq_bytes(feed.last_seq + 1)])
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                    log.warning("%s: KV-event replay did not answer in %.0f s", feed.url, REPLAY_TIMEOUT_S)
                    feed.synced = False
                    return
                _, _, raw_seq, payload = await dealer.recv_multipart()
                if raw_seq == E.END_SEQ:
                    break
                # Batches from last_seq + 1 on, or one snapshot (it begins with AllBlocksCleared).
                seq = int.from_bytes(raw_seq, "big", signed=True)
                batch = self.decode(feed, seq, payload)
                if batch is None:
                    return
                self.apply(feed, seq, batch)
        finally:
            dealer.close(linger=0)
        feed.synced, feed.last_heard = True, time.monotonic()
        feed.counters["resyncs"] += 1
        feed.counters["resync_ms"] = round((time.perf_counter() - started) * 1e3, 3)
