"""TransferAgent: the data plane's one public object, shaped like NIXL's agent.

    agent = TransferAgent("decode-0", secret)
    kv = agent.allocate_region("kv", nbytes)         # torch uint8 tensor in /dev/shm, already registered
    peer = agent.add_peer(prefill_metadata)           # authenticated handshake, both ways
    h = agent.read(peer, [("kv", 0, n)], [("kv", off, n)], notify=b"done:42")
    h.wait(timeout=5)

A peer becomes reachable through the metadata blob it exports (name, address, host); everything it
grants (regions, sizes, shm segments, NIXL metadata) comes later over the authenticated connection,
and is refreshed there whenever it registers or deregisters, so a grant can neither be forged by
whoever carried the blob nor go stale. Backend per transfer: `shm` when the peer's regions are mapped
(same host), `nixl` when this agent was created with backend="nixl", else `tcp`.
"""
from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable

import numpy as np

from kvhandoff.transfer import shm
from kvhandoff.transfer.descriptors import DescList, Plan, plan
from kvhandoff.transfer.errors import PeerError, TransferError
from kvhandoff.transfer.handle import Handle, Op
from kvhandoff.transfer.memory import SHM_DIR, Region, Segment, byte_view, create_segment, sweep_stale_segments
from kvhandoff.transfer.protocol import Kind, byte_views
from kvhandoff.transfer.tcp import Channel, Inbound, Server, client_handshake, connect

log = logging.getLogger(__name__)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")     # bind every interface: no address a peer can connect to


class Backend(StrEnum):
    """How an agent moves bytes (`--kv-backend`)."""
    AUTO = "auto"           # shm to a peer on this host (when it can map our segments), tcp otherwise
    SHM = "shm"
    TCP = "tcp"
    NIXL = "nixl"           # through NIXL (peers need it too)


BACKENDS = tuple(b.value for b in Backend)
INLINE_COPY_BYTES = 256 << 10   # smaller shm copies run in the caller: a thread hop costs more than the copy
METADATA_VERSION = 1
# Every agent sweeps the host for segments of dead owners this often: a worker that crashed before any
# peer connected to it (so nobody saw it die) leaves nothing behind for longer than this.
STALE_SWEEP_S = 5.0


@dataclass(frozen=True)
class RegionInfo:
    name: str
    nbytes: int
    shm_segment: str | None     # the /dev/shm file holding it, if a same-host peer can map it


@dataclass(eq=False)
class Peer:
    name: str
    pid: int
    channel: Channel
    same_host: bool
    grants: dict[str, dict] = field(default_factory=dict)           # region name -> grant
    segments: dict[str, Segment] = field(default_factory=dict)      # its shm segments mapped here
    shm_views: dict[str, np.ndarray] = field(default_factory=dict)  # region name -> mapped bytes
    no_shm: dict[str, str] = field(default_factory=dict)            # region name -> why not mapped

    def release(self) -> None:
        self.shm_views = {}
        for seg in self.segments.values():
            seg.release()
        self.segments = {}


class TransferAgent:
    """One process's end of the data plane. `secret` is shared by every agent that may talk to this
    one; `backend` "auto" picks shm or tcp per transfer, "shm"/"tcp" force one, "nixl" sends through
    NIXL (peers need it too). The server listens on `listen_host` (loopback by default); a peer that
    moves no byte for `peer_timeout_s` is declared dead (we ping every `heartbeat_s` when a connection
    is quiet in either direction: a peer answers a ping, never a notification).
    `shm_dir` holds allocated regions: a huge-page tmpfs there doubles shm speed (see memory.py)."""

    def __init__(self, name: str, secret: bytes | str, backend: str = "auto", listen_host: str = "127.0.0.1",
                 listen_port: int = 0, *, advertise_host: str | None = None, shm_dir: str = SHM_DIR,
                 heartbeat_s: float = 1.0, peer_timeout_s: float = 10.0, connect_timeout_s: float = 5.0,
                 protocol: str = "", on_peer_lost: Callable[[str, str], None] | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        backend = Backend(backend)
        if not secret:
            raise ValueError("a shared secret is required: peers authenticate with it")
        assert heartbeat_s < peer_timeout_s, "a peer must hear from us before it gives up on us"
        self.name, self.backend, self.protocol = name, backend, protocol
        # Told (name, reason), on the thread that noticed, when a peer's connection dies: every
        # transfer posted to it has failed (and every later one fails at once, "connection lost"),
        # `peers` no longer lists it, and add_peer connects to it anew.
        self.on_peer_lost = on_peer_lost
        self.instance = secrets.token_hex(8)
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self._heartbeat_s, self._peer_timeout_s, self._connect_timeout_s = heartbeat_s, peer_timeout_s, connect_timeout_s
        self._lock = threading.RLock()
        self._regions: dict[str, Region] = {}
        self._by_id: dict[int, Region] = {}
        self._region_ids = itertools.count(1)
        self._segments: list[Segment] = []
        self._peers: dict[str, Peer] = {}
        self._notes: collections.deque[tuple[str, bytes]] = collections.deque()
        self._notes_cv = threading.Condition()
        self._sweep_pids: dict[int, float] = {}         # same-host peers that died -> sweep their segments until
        self._host = shm.host_id()
        self._shm_dir = os.path.abspath(shm_dir)
        self._closed = False
        # Segments left by crashed agents of this user; ours are unlinked even if close() is never called.
        sweep_stale_segments(directory=self._shm_dir)
        self._finalizer = weakref.finalize(self, _unlink_all, self._segments)
        self._nixl = None
        if backend == "nixl":
            from kvhandoff.transfer.nixl_backend import NixlEngine
            self._nixl = NixlEngine(name, on_notify=self._deliver)
        self._server = Server(name, self._secret, listen_host, listen_port, regions=lambda: self._by_id,
                              welcome=self._grant_table, on_notify=self._deliver, on_closed=self._inbound_closed,
                              peer_timeout_s=peer_timeout_s, handshake_timeout_s=connect_timeout_s,
                              protocol=protocol)
        if advertise_host is None and listen_host in WILDCARD_HOSTS:
            self._server.close()
            raise ValueError("listening on every interface: pass advertise_host, the address peers connect to")
        if listen_host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("%s: transfer agent listening on %s; only peers holding the secret get in", name, listen_host)
        self.address = (advertise_host or self._server.address[0], self._server.address[1])
        self._copier = shm.CopyWorker(f"kvh-copy-{name}")
        self._stop = threading.Event()
        self._housekeeper = threading.Thread(target=self._housekeep, name=f"kvh-house-{name}", daemon=True)
        self._housekeeper.start()

    # ------------------------------------------------------------------------------------- memory

    def register(self, name: str, memory) -> RegionInfo:
        """Grant peers access to `memory` (CPU torch tensor, numpy array, bytearray, writable buffer)."""
        arr = byte_view(memory)
        with self._lock:
            self._check_open()
            if name in self._regions:
                raise ValueError(f"region {name!r} is already registered")
            segment, offset = next(((s, o) for s in self._segments if (o := s.contains(arr)) is not None), (None, 0))
            region = Region(name, next(self._region_ids), arr, memory, segment, offset)
            if self._nixl is not None:
                self._nixl.register(region)
            self._regions[name] = region
            self._by_id = {**self._by_id, region.id: region}        # replaced, never mutated: servers read it unlocked
        self._server.broadcast(Kind.GRANTS, self._grant_table())
        return RegionInfo(name, region.nbytes, segment.name if segment else None)

    def allocate_region(self, name: str, nbytes: int):
        """A new registered region in shared memory (/dev/shm, mode 0600), as a torch uint8 tensor.

        Same-host peers copy straight into and out of it (the shm backend); view it as any dtype and
        shape (`t.view(torch.bfloat16).view(...)`). The segment is unlinked at deregister/close.
        """
        import torch
        return torch.from_numpy(self._allocate(name, nbytes))

    def _allocate(self, name: str, nbytes: int) -> np.ndarray:
        """allocate_region as a numpy array: for processes that need not import torch (tests, bench)."""
        with self._lock:
            self._check_open()
            if name in self._regions:
                raise ValueError(f"region {name!r} is already registered")
        segment = create_segment(f"{self.name}.{name}", nbytes, self._shm_dir)
        with self._lock:
            self._segments.append(segment)
        try:
            self.register(name, segment.array)
        except BaseException:
            self._drop_segment(segment)
            raise
        return segment.array

    def deregister(self, name: str) -> None:
        with self._lock:
            region = self._regions.pop(name, None)
            if region is None:
                raise KeyError(f"region {name!r} is not registered")
            self._by_id = {k: v for k, v in self._by_id.items() if k != region.id}
            if self._nixl is not None:
                self._nixl.deregister(region)
            if region.segment is not None and all(r.segment is not region.segment for r in self._regions.values()):
                self._drop_segment(region.segment)
        self._server.broadcast(Kind.GRANTS, self._grant_table())

    @property
    def regions(self) -> dict[str, RegionInfo]:
        with self._lock:
            return {n: RegionInfo(n, r.nbytes, r.segment.name if r.segment else None) for n, r in self._regions.items()}

    # ------------------------------------------------------------------------------------- peers

    def metadata(self) -> bytes:
        """What a peer needs to reach and authenticate us. Never contains the secret."""
        return json.dumps({"v": METADATA_VERSION, "name": self.name, "instance": self.instance, "host": self._host,
                           "pid": os.getpid(), "addr": list(self.address), "nixl": self._nixl is not None,
                           "protocol": self.protocol}).encode()

    def add_peer(self, metadata: bytes) -> str:
        """Connect to and authenticate the agent described by `metadata`; returns its name.

        Raises AuthenticationError (wrong secret on either side: nothing is changed), PeerError.
        """
        self._check_open()
        try:
            meta = json.loads(metadata)
            name, address, version = str(meta["name"]), (str(meta["addr"][0]), int(meta["addr"][1])), meta["v"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise PeerError(f"malformed peer metadata: {e!r}") from None
        if version != METADATA_VERSION:
            raise PeerError(f"peer {name!r} speaks metadata version {version!r}, we speak {METADATA_VERSION}")
        if meta.get("protocol", "") != self.protocol:
            raise PeerError(f"peer {name!r} speaks protocol {meta.get('protocol', '')!r}, this agent "
                            f"{self.protocol!r}: run the same version everywhere")
        if name == self.name:
            raise PeerError(f"peer {name!r} has this agent's own name")
        if self.backend == "nixl" and not meta.get("nixl"):
            raise PeerError(f"peer {name!r} has no nixl backend; create it with backend='nixl'")
        try:
            sock = connect(address, self._connect_timeout_s)
        except OSError as e:
            raise PeerError(f"cannot connect to peer {name!r} at {address[0]}:{address[1]}: {e}") from None
        try:
            welcome = client_handshake(sock, self.name, name, self._secret,
                                       {"instance": self.instance, "host": self._host, "pid": os.getpid(),
                                        "protocol": self.protocol})
        except BaseException as e:
            sock.close()
            if isinstance(e, (OSError, ValueError, KeyError, TypeError, AttributeError)):
                raise PeerError(f"handshake with peer {name!r} failed: {e!r}") from None
            raise
        # Host and pid from the authenticated WELCOME, not the blob: they decide what we map and sweep.
        peer = Peer(name, welcome.get("pid", 0), None, same_host=welcome.get("host") == self._host)
        peer.channel = Channel(sock, name, peer_timeout_s=self._peer_timeout_s, on_notify=self._deliver,
                               on_grants=self._on_grants, on_dead=self._on_peer_dead)
        with self._lock:
            old = self._peers.get(name)
            self._peers[name] = peer
        if old is not None:
            self._close_peer(old, "replaced by a new connection")
        try:
            self._apply_grants(peer, welcome)
            if self.backend == "shm" and peer.no_shm:
                region, why = next(iter(peer.no_shm.items()))
                raise PeerError(f"backend 'shm': region {region!r} of peer {name!r} cannot be mapped: {why}")
        except BaseException:
            with self._lock:
                if self._peers.get(name) is peer:
                    del self._peers[name]
            self._close_peer(peer, "add_peer failed")
            raise
        return name

    @property
    def peers(self) -> list[str]:
        """The peers we have a live connection to."""
        return [name for name, peer in list(self._peers.items()) if peer.channel.dead is None]

    def peer_backend(self, name: str) -> str:
        """The backend transfers to `name` use for regions that are all mapped ("shm") or not."""
        peer = self._peer(name)
        if self.backend in ("tcp", "nixl"):
            return self.backend
        return "shm" if not peer.no_shm and peer.grants else "tcp"

    # ------------------------------------------------------------------------------------- transfers

    def read(self, peer: str, local_descs, remote_descs, notify: bytes | None = None) -> Handle:
        """Pull the peer's `remote_descs` into our `local_descs`; `notify` reaches the peer after the data."""
        return self._post(Op.READ, peer, local_descs, remote_descs, notify)

    def write(self, peer: str, local_descs, remote_descs, notify: bytes | None = None) -> Handle:
        """Push our `local_descs` into the peer's `remote_descs`; `notify` reaches the peer after the data."""
        return self._post(Op.WRITE, peer, local_descs, remote_descs, notify)

    def _post(self, op: Op, peer_name: str, local_descs, remote_descs, notify: bytes | None) -> Handle:
        peer = self._peer(peer_name)
        notify = bytes(notify or b"")
        local, remote = DescList.of(local_descs), DescList.of(remote_descs)
        with self._lock:
            local_regions = [self._regions.get(n) for n in local.names]
            grants, mapped = peer.grants, peer.shm_views
        local.check_bounds({r.name: r.nbytes for r in local_regions if r is not None}, "local")
        remote.check_bounds({n: g["nbytes"] for n, g in grants.items()}, f"peer {peer.name!r}")
        p = plan(local, remote)
        if peer.channel.dead is not None:       # (its mappings are gone: no backend to choose)
            handle = Handle(op, peer.name, self.backend, p.nbytes, len(p))
            handle._finish(f"connection lost: {peer.channel.dead}")
            return handle
        backend = self._choose_backend(peer, remote.names, mapped)
        handle = Handle(op, peer.name, backend, p.nbytes, len(p))
        if backend == "shm":
            self._post_shm(op, peer, p, [r.array for r in local_regions], [mapped[n] for n in p.remote.names],
                           handle, notify)
        elif backend == "nixl":
            self._post_nixl(op, peer, p, local_regions, grants, handle, notify)
        else:
            ids = np.array([grants[n]["id"] for n in remote.names], np.uint32)[p.remote.region]
            local_views = byte_views([memoryview(r.array) for r in local_regions], p.local.region, p.local.offset,
                                     p.local.length)
            peer.channel.post(op, handle, ids, p.remote.offset, p.remote.length, local_views, notify)
        return handle

    def _choose_backend(self, peer: Peer, remote_regions: tuple[str, ...], mapped: dict[str, np.ndarray]) -> str:
        if self.backend in ("tcp", "nixl"):
            return self.backend
        unmapped = [n for n in remote_regions if n not in mapped]
        if not unmapped:
            return "shm"
        if self.backend == "shm":
            raise PeerError(f"backend 'shm': region {unmapped[0]!r} of peer {peer.name!r} is not mapped: "
                            f"{peer.no_shm.get(unmapped[0], 'unknown region')}")
        return "tcp"

    def _post_shm(self, op: Op, peer: Peer, p: Plan, local: list[np.ndarray], remote: list[np.ndarray],
                  handle: Handle, notify: bytes) -> None:
        def run() -> None:
            if peer.channel.dead is not None:       # queued behind a copy that found the peer dead
                handle._finish(f"connection lost: {peer.channel.dead}")
                return
            try:
                shm.copy(op, p, local, remote)
            except Exception as e:
                handle._finish(f"copy failed: {e}")
                return
            # The copy cannot notice a peer dying, so the channel vouches for it: a peer that died
            # meanwhile may have left its side half-made (READ) or will never use ours (WRITE).
            if peer.channel.dead is not None:
                handle._finish(f"connection lost: {peer.channel.dead}")
            elif notify:
                peer.channel.notify(notify, handle)       # done once the notification is on the wire
            else:
                handle._finish()
        if p.nbytes <= INLINE_COPY_BYTES:
            run()
        else:
            job = shm.CopyJob(run)
            handle._on_wait = job.run_unless_claimed
            self._copier.submit(job)

    def _post_nixl(self, op: Op, peer: Peer, p: Plan, local_regions: list[Region], grants: dict, handle: Handle,
                   notify: bytes) -> None:
        local_base = np.array([r.addr for r in local_regions], np.uint64)[p.local.region]
        remote_base = np.array([grants[n]["addr"] for n in p.remote.names], np.uint64)[p.remote.region]
        try:
            xfer, state = self._nixl.post(op, peer.name, local_base + p.local.offset.astype(np.uint64),
                                          remote_base + p.remote.offset.astype(np.uint64), p.local.length, notify)
        except Exception as e:
            handle._finish(f"nixl refused the transfer: {e}")
            return
        nixl, channel = self._nixl, peer.channel

        def poll(h: Handle) -> None:
            nonlocal state
            if state == "PROC":
                state = nixl.check(xfer)
            if state == "DONE":
                done = h._finish()
            elif state == "ERR":
                done = h._finish("nixl reported an error")
            elif channel.dead is not None:          # UCX may not notice a dead peer for a long time
                done = h._finish(f"connection lost: {channel.dead}")
            else:
                return
            if done:
                nixl.release(xfer)
        handle._poller = poll

    # ------------------------------------------------------------------------------------- notifications

    def send_notification(self, peer: str, msg: bytes) -> None:
        """Send `msg` to a peer: over our connection to it, or over its connection to us."""
        p = self._peers.get(peer)
        if p is not None and p.channel.dead is None and self._nixl is not None and self._nixl.has_remote(peer):
            self._nixl.send(peer, bytes(msg))     # same path as the nixl transfers' notifications: stays in order
        elif p is not None and p.channel.dead is None:
            p.channel.notify(bytes(msg))
        elif not self._server.notify(peer, bytes(msg)):
            raise PeerError(f"no live connection to or from peer {peer!r}")

    def get_notifications(self) -> list[tuple[str, bytes]]:
        """Every notification received so far, as (peer, message), oldest first."""
        with self._notes_cv:
            notes = list(self._notes)
            self._notes.clear()
        return notes

    def wait_notification(self, timeout: float | None = None) -> tuple[str, bytes] | None:
        """The oldest notification, waiting up to `timeout` seconds for one; None if none came."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._notes_cv:
                if self._notes:
                    return self._notes.popleft()
                left = None if deadline is None else deadline - time.monotonic()
                if self._closed or (left is not None and left <= 0):
                    return None
                self._notes_cv.wait(left)

    def _deliver(self, peer: str, msg: bytes) -> None:
        with self._notes_cv:
            self._notes.append((peer, msg))
            self._notes_cv.notify_all()

    # ------------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Disconnect every peer, stop serving, deregister everything and unlink our shm segments."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        self._stop.set()
        with self._notes_cv:
            self._notes_cv.notify_all()                 # wait_notification() returns None once closed
        self._server.close()
        for peer in peers:
            self._close_peer(peer, "agent closed")
        for name in list(self._regions):
            self.deregister(name)
        self._copier.stop()
        if self._nixl is not None:
            self._nixl.close()
        self._finalizer()
        self._housekeeper.join(2.0)

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self.name!r} is closed")

    def _peer(self, name: str) -> Peer:
        peer = self._peers.get(name)
        if peer is None:
            raise PeerError(f"unknown peer {name!r} (known: {sorted(self._peers)})")
        return peer

    def _grant_table(self) -> dict:
        with self._lock:
            return {"name": self.name, "instance": self.instance, "host": self._host, "pid": os.getpid(),
                    "regions": {n: r.grant() for n, r in self._regions.items()},
                    "nixl": self._nixl.metadata() if self._nixl is not None else None}

    def _apply_grants(self, peer: Peer, table: dict) -> None:
        grants = table["regions"]
        if peer.same_host and self.backend in ("auto", "shm"):
            segments, views, why = shm.map_grants(grants, peer.segments)
        else:
            segments, views, why = {}, {}, {n: "peer on another host" for n in grants}
        if self._nixl is not None and table.get("nixl"):
            self._nixl.load_remote(peer.name, table["nixl"])
        with self._lock:
            peer.segments, peer.shm_views, peer.no_shm, peer.grants = segments, views, why, grants

    def _on_grants(self, peer_name: str, table: dict) -> None:
        peer = self._peers.get(peer_name)
        if peer is not None:
            self._apply_grants(peer, table)

    def _on_peer_dead(self, peer_name: str, reason: str) -> None:
        peer = self._peers.get(peer_name)
        if peer is None or peer.channel.dead is None:
            return                                  # a channel we closed ourselves (removed, replaced)
        log.warning("%s: connection to peer %r lost: %s", self.name, peer_name, reason)
        peer.release()                              # its mappings: a dead peer's pool is never read again
        if peer.same_host:
            self._schedule_sweep(int(peer.pid))
        if self.on_peer_lost is not None:
            try:
                self.on_peer_lost(peer_name, reason)
            except Exception:
                log.exception("%s: on_peer_lost(%r) failed", self.name, peer_name)

    def _inbound_closed(self, conn: Inbound, reason: str) -> None:
        log.info("%s: peer %r disconnected from us: %s", self.name, conn.peer, reason)
        if conn.hello.get("host") == self._host:
            self._schedule_sweep(int(conn.hello.get("pid", 0)))

    def _schedule_sweep(self, pid: int) -> None:
        # A dead owner's segments can only be swept once the kernel has finished its exit, a moment
        # after its sockets closed: keep trying for a while.
        if pid > 0 and pid != os.getpid():
            with self._lock:
                self._sweep_pids[pid] = time.monotonic() + 30.0

    def _close_peer(self, peer: Peer, reason: str) -> None:
        peer.channel.close(reason)
        if self._nixl is not None:
            self._nixl.remove_remote(peer.name)
        peer.release()

    def _drop_segment(self, segment: Segment) -> None:
        segment.unlink()
        segment.release()
        with self._lock:
            if segment in self._segments:
                self._segments.remove(segment)

    def _housekeep(self) -> None:
        tick = min(self._heartbeat_s / 2, 0.25)
        next_full_sweep = time.monotonic() + STALE_SWEEP_S
        while not self._stop.wait(tick):
            now = time.monotonic()
            for peer in list(self._peers.values()):
                # Quiet either way: a peer we only send notifications to answers none of them, and
                # our receiver gives up on a peer it has not heard from in peer_timeout_s.
                channel, beat = peer.channel, self._heartbeat_s
                quiet = now - channel.last_sent >= beat or now - channel.last_received >= beat
                if channel.dead is None and quiet and now - channel.last_ping >= beat:
                    channel.ping()
            if now >= next_full_sweep:      # owners that died before any peer connected to them
                sweep_stale_segments(directory=self._shm_dir)
                next_full_sweep = now + STALE_SWEEP_S
            with self._lock:
                sweeps = list(self._sweep_pids.items())
            for pid, until in sweeps:
                if sweep_stale_segments(pid, self._shm_dir) or now > until:
                    with self._lock:
                        self._sweep_pids.pop(pid, None)


def _unlink_all(segments: list[Segment]) -> None:
    for segment in list(segments):
        segment.unlink()
