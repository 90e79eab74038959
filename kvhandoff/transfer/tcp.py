"""The tcp backend and the control connection every backend uses.

`Server`: one listening socket per agent and a thread per authenticated peer that services the
peer's READs and WRITEs straight out of / into registered regions (sendmsg gather, recvmsg_into
scatter), re-checking every descriptor against what is registered now (never trusting the
initiator's own check), and delivers the peer's notifications.

`Channel`: our connection to one peer's server. Requests are pipelined (many in flight, answered in
order); a sender thread writes them so read()/write() never block on the network, and a receiver
thread lands replies in place. Liveness: we ping when idle, the server pongs; a socket that makes no
progress for `peer_timeout_s` (either way) or breaks kills the channel, and every pending operation
turns ERROR with the cause. Nothing waits forever.
"""
from __future__ import annotations

import itertools
import json
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvhandoff.transfer.errors import AuthenticationError, OutOfBoundsError
from kvhandoff.transfer.handle import Handle, Op
from kvhandoff.transfer.memory import Region
from kvhandoff.transfer.protocol import (FRAME, HANDSHAKE_VERSION, MAX_BODY, STALLED, ConnectionLost, Kind,
                                         byte_views, drain, frame, hello_frame, json_frame, mac, pad_length,
                                         padding, parse_xfer_body, recv_body, recv_exact, recv_frame,
                                         recv_hello_frame, recv_into_buffers, send_buffers, send_nowait,
                                         set_timeout, tune, xfer_body)

log = logging.getLogger(__name__)
DRAIN_LIMIT = 1 << 30       # a refused WRITE larger than this closes the connection instead of being drained
SMALL_TABLE = 16              # descriptor tables up to this size are checked in plain Python
INLINE_SEND_BYTES = 64 << 10  # WRITE payloads up to this are sent by the caller when the queue is empty


# ---------------------------------------------------------------------------------------------- handshake

def client_handshake(sock: socket.socket, me: str, expected: str, secret: bytes, hello_extra: dict) -> dict:
    """Authenticate both ways as client; returns the server's WELCOME (its grants)."""
    nonce_c = secrets.token_bytes(32)
    sock.sendall(hello_frame(Kind.HELLO, {"v": HANDSHAKE_VERSION, "name": me, "nonce": nonce_c.hex(), **hello_extra}))
    kind, body = recv_hello_frame(sock)
    if kind is Kind.REFUSED:
        raise AuthenticationError(f"peer {expected!r} refused the handshake: {json.loads(body)['reason']}")
    if kind is not Kind.CHALLENGE:
        raise AuthenticationError(f"peer {expected!r} answered HELLO with {kind.name}")
    challenge = json.loads(body)
    server, nonce_s = challenge["name"], bytes.fromhex(challenge["nonce"])
    expect = mac(secret, b"kvh-server", nonce_c, nonce_s, server.encode(), me.encode())
    if not secrets.compare_digest(bytes.fromhex(challenge["mac"]), expect):
        raise AuthenticationError(f"peer {expected!r} could not prove it holds the shared secret "
                                  f"(wrong secret on one side, or not the peer you think)")
    if server != expected:
        raise AuthenticationError(f"the agent at that address is {server!r}, not {expected!r}")
    sock.sendall(hello_frame(Kind.AUTH, {"mac": mac(secret, b"kvh-client", nonce_s, nonce_c, me.encode(),
                                                    server.encode()).hex()}))
    kind, body = recv_hello_frame(sock, MAX_BODY)
    if kind is not Kind.WELCOME:
        reason = json.loads(body).get("reason", kind.name) if kind is Kind.REFUSED else kind.name
        raise AuthenticationError(f"peer {expected!r} refused the handshake: {reason}")
    return json.loads(body)


def server_handshake(sock: socket.socket, me: str, secret: bytes, welcome: Callable[[], dict],
                     protocol: str = "") -> dict:
    """Authenticate both ways as server; returns the client's HELLO. Raises on any failure. A client
    speaking another application `protocol` is refused, with both names in the reason."""
    kind, body = recv_hello_frame(sock)
    hello = json.loads(body)
    if kind is not Kind.HELLO:
        raise AuthenticationError(f"expected HELLO, got {kind.name}")
    if hello.get("v") != HANDSHAKE_VERSION:
        reason = (f"{hello.get('name')!r} speaks transfer handshake v{hello.get('v')}, {me!r} speaks "
                  f"v{HANDSHAKE_VERSION}: run one kvhandoff version on both")
        sock.sendall(hello_frame(Kind.REFUSED, {"reason": reason}))
        raise AuthenticationError(reason)
    if hello.get("protocol", "") != protocol:
        reason = f"{hello.get('name')!r} speaks protocol {hello.get('protocol', '')!r}, {me!r} speaks {protocol!r}"
        sock.sendall(hello_frame(Kind.REFUSED, {"reason": reason}))
        raise AuthenticationError(reason)
    client, nonce_c = str(hello["name"]), bytes.fromhex(hello["nonce"])
    if len(nonce_c) != 32:
        raise AuthenticationError("bad nonce")
    nonce_s = secrets.token_bytes(32)
    sock.sendall(hello_frame(Kind.CHALLENGE, {"name": me, "nonce": nonce_s.hex(), "mac": mac(
        secret, b"kvh-server", nonce_c, nonce_s, me.encode(), client.encode()).hex()}))
    kind, body = recv_hello_frame(sock)
    expect = mac(secret, b"kvh-client", nonce_s, nonce_c, client.encode(), me.encode())
    if kind is not Kind.AUTH or not secrets.compare_digest(bytes.fromhex(json.loads(body)["mac"]), expect):
        sock.sendall(hello_frame(Kind.REFUSED, {"reason": "authentication failed (wrong shared secret?)"}))
        raise AuthenticationError(f"{client!r} failed authentication")
    sock.sendall(hello_frame(Kind.WELCOME, welcome()))
    return hello


# ---------------------------------------------------------------------------------------------- server

@dataclass(eq=False)
class Inbound:
    """An authenticated connection from a peer to our server."""
    peer: str
    hello: dict
    sock: socket.socket
    lock: threading.Lock

    def send(self, buffers: Iterable) -> None:
        with self.lock:
            send_buffers(self.sock, buffers)


class Server:
    def __init__(self, name: str, secret: bytes, host: str, port: int, *, regions: Callable[[], dict[int, Region]],
                 welcome: Callable[[], dict], on_notify: Callable[[str, bytes], None],
                 on_closed: Callable[[Inbound, str], None], peer_timeout_s: float, handshake_timeout_s: float,
                 protocol: str = ""):
        self.name, self._secret, self._protocol = name, secret, protocol
        self._regions, self._welcome, self._on_notify, self._on_closed = regions, welcome, on_notify, on_closed
        self._peer_timeout_s, self._handshake_timeout_s = peer_timeout_s, handshake_timeout_s
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.address = self._listener.getsockname()[:2]
        self._inbound: dict[str, Inbound] = {}
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name=f"kvh-accept-{name}", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._inbound = list(self._inbound.values()), {}
        for conn in conns:
            _shutdown(conn.sock)

    def broadcast(self, kind: Kind, obj: dict) -> None:
        with self._lock:
            conns = list(self._inbound.values())
        for conn in conns:
            try:
                conn.send([json_frame(kind, obj)])
            except OSError:
                pass                                 # its serving thread will notice and clean up

    def notify(self, peer: str, msg: bytes) -> bool:
        conn = self._inbound.get(peer)
        if conn is None:
            return False
        conn.send([frame(Kind.NOTIFY, 0, msg)])
        return True

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, addr), name=f"kvh-serve-{self.name}",
                             daemon=True).start()

    def _serve(self, sock: socket.socket, addr) -> None:
        try:
            tune(sock, self._handshake_timeout_s)
            hello = server_handshake(sock, self.name, self._secret, self._welcome, self._protocol)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, AuthenticationError) as e:
            log.warning("%s: handshake from %s refused: %s", self.name, addr, e)
            sock.close()
            return
        conn = Inbound(str(hello["name"]), hello, sock, threading.Lock())
        set_timeout(sock, self._peer_timeout_s)
        with self._lock:
            old = self._inbound.get(conn.peer)
            self._inbound[conn.peer] = conn
        if old is not None:
            _shutdown(old.sock)                        # a peer that reconnects replaces its old connection
        reason = "closed"
        try:
            while True:
                kind, req_id, body = recv_frame(sock)
                if kind is Kind.READ:
                    self._serve_read(conn, req_id, body)
                elif kind is Kind.WRITE:
                    self._serve_write(conn, req_id, body)
                elif kind is Kind.NOTIFY:
                    self._on_notify(conn.peer, bytes(body))
                elif kind is Kind.PING:
                    conn.send([frame(Kind.PONG)])
                else:
                    raise ConnectionLost(f"unexpected {kind.name} from a client")
        except STALLED:
            reason = f"no traffic from peer for {self._peer_timeout_s}s"
        except (OSError, ValueError) as e:
            reason = str(e) or type(e).__name__
        finally:
            with self._lock:
                if self._inbound.get(conn.peer) is conn:
                    del self._inbound[conn.peer]
            _shutdown(sock)
            sock.close()
            if not self._closed:
                self._on_closed(conn, reason)

    def _views(self, table: np.ndarray) -> tuple[int, Iterable[memoryview]]:
        """(total bytes, byte views of the requested ranges), the views made lazily; OutOfBoundsError
        unless every range lies inside a live region (all checked before the first byte moves)."""
        regions = self._regions()
        if len(table) <= SMALL_TABLE:           # a few descriptors: a loop beats numpy's fixed costs
            views = []
            for i, (rid, _, offset, length) in enumerate(table.tolist()):
                region = regions.get(rid)
                if region is None or not 0 < length <= region.nbytes or offset > region.nbytes - length:
                    raise OutOfBoundsError(_refusal(regions, i, rid, offset, length))
                views.append(memoryview(region.array)[offset:offset + length])
            return sum(len(v) for v in views), views
        ids, inverse = np.unique(table["region"], return_inverse=True)
        ids = ids.tolist()
        for k, rid in enumerate(ids):
            if rid not in regions:
                i = int(np.flatnonzero(inverse == k)[0])
                raise OutOfBoundsError(_refusal(regions, i, rid, int(table["offset"][i]), int(table["length"][i])))
        sizes = np.array([regions[rid].nbytes for rid in ids], np.uint64)[inverse]
        offset, length = table["offset"], table["length"]
        bad = (length == 0) | (length > sizes) | (offset > sizes - np.minimum(length, sizes))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise OutOfBoundsError(_refusal(regions, i, ids[inverse[i]], int(offset[i]), int(length[i])))
        total = int(length.sum(dtype=np.uint64))   # no wrap: each length is at most its region's size
        return total, byte_views([memoryview(regions[rid].array) for rid in ids], inverse, offset, length)

    def _serve_read(self, conn: Inbound, req_id: int, body: bytearray) -> None:
        table, notify = parse_xfer_body(body)
        try:
            total, views = self._views(table)
        except OutOfBoundsError as e:
            conn.send([frame(Kind.FAILED, req_id, f"refused by {self.name!r}: {e}".encode())])
            return
        conn.send(itertools.chain([FRAME.pack(Kind.READ_DATA, req_id, total)], views, [padding(total)]))
        if notify:
            self._on_notify(conn.peer, notify)

    def _serve_write(self, conn: Inbound, req_id: int, body: bytearray) -> None:
        table, notify = parse_xfer_body(body)
        try:
            total, views = self._views(table)
        except OutOfBoundsError as e:
            total = sum(table["length"].tolist())
            if total > DRAIN_LIMIT:
                raise ConnectionLost(f"refused WRITE of {total} bytes: {e}") from None
            drain(conn.sock, total + pad_length(total))  # the payload follows the request: skip it, stay in step
            conn.send([frame(Kind.FAILED, req_id, f"refused by {self.name!r}: {e}".encode())])
            return
        recv_into_buffers(conn.sock, views)
        drain(conn.sock, pad_length(total))
        if notify:
            self._on_notify(conn.peer, notify)       # after the data landed: the notification means "ready"
        conn.send([frame(Kind.WRITE_DONE, req_id)])


def _refusal(regions: dict[int, Region], i: int, rid: int, offset: int, length: int) -> str:
    region = regions.get(rid)
    if region is None:
        return f"descriptor {i}: region id {rid} is not registered (deregistered?)"
    return (f"descriptor {i} (region {region.name!r}, offset {offset}, length {length}) is outside the "
            f"region's {region.nbytes} bytes")


# ---------------------------------------------------------------------------------------------- client

@dataclass(eq=False)
class _Pending:
    handle: Handle
    views: Iterable[memoryview] | None      # READ: where the payload lands (made as it arrives)


class Channel:
    def __init__(self, sock: socket.socket, peer: str, *, peer_timeout_s: float,
                 on_notify: Callable[[str, bytes], None], on_grants: Callable[[str, dict], None],
                 on_dead: Callable[[str, str], None]):
        self.peer, self.sock = peer, sock
        self._on_notify, self._on_grants, self._on_dead = on_notify, on_grants, on_dead
        self._peer_timeout_s = peer_timeout_s
        set_timeout(sock, peer_timeout_s)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0                     # items put in the outbox and not yet sent
        self._send_lock = threading.Lock()   # held while bytes go out: frames never interleave
        self._lock = threading.Lock()
        self.dead: str | None = None
        self.last_sent = self.last_received = self.last_ping = time.monotonic()
        self._sender = threading.Thread(target=self._send_loop, name=f"kvh-send-{peer}", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"kvh-recv-{peer}", daemon=True)
        self._sender.start()
        self._receiver.start()

    def post(self, op: Op, handle: Handle, remote_ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
             local_views: Iterable[memoryview], notify: bytes) -> None:
        """Send a READ or WRITE request; `local_views` (a generator is best: it is consumed as the
        bytes move) is where a READ lands or what a WRITE sends, `handle.nbytes` in all."""
        req_id = next(self._ids) & 0xFFFFFFFF
        head = frame(Kind.READ if op is Op.READ else Kind.WRITE, req_id, xfer_body(remote_ids, offsets, lengths, notify))
        with self._lock:
            if self.dead is not None:
                handle._finish(f"connection lost: {self.dead}")
                return
            self._pending[req_id] = _Pending(handle, local_views if op is Op.READ else None)
        if op is Op.READ:
            self._send([head], small=True)
        elif handle.nbytes <= INLINE_SEND_BYTES:
            self._send([head, *local_views, padding(handle.nbytes)], small=True)
        else:
            self._send(itertools.chain([head], local_views, [padding(handle.nbytes)]))

    def notify(self, msg: bytes, handle: Handle | None = None) -> None:
        """Send a notification; `handle`, if given, finishes once it is on the wire (or fails)."""
        self._send([frame(Kind.NOTIFY, 0, msg)], handle, small=True)
        if self.dead is not None:
            self._fail_outbox()

    def ping(self) -> None:
        self.last_ping = time.monotonic()
        self._send([frame(Kind.PING)])

    def _send(self, buffers: Iterable, handle: Handle | None = None, small: bool = False) -> None:
        """Small frames go out from the caller's thread when nothing is queued before them (saves a
        thread hop, ~half the latency of a 4 KiB op) and the socket takes them without blocking;
        everything else, in order, via the sender thread. The caller never waits on the network."""
        if small and self._send_lock.acquire(blocking=False):
            try:
                if self._queued == 0 and self.dead is None:
                    try:
                        buffers = send_nowait(self.sock, buffers)
                    except OSError as e:
                        self._die(f"send failed: {e}")
                    if not buffers or self.dead is not None:
                        self.last_sent = time.monotonic()
                        if handle is not None:
                            handle._finish(None if self.dead is None else f"connection lost: {self.dead}")
                        return
                    self._enqueue(buffers, handle)       # the tail, queued before the lock lets anyone pass
                    return
            finally:
                self._send_lock.release()
        self._enqueue(buffers, handle)

    def _enqueue(self, buffers: Iterable, handle: Handle | None) -> None:
        with self._lock:
            self._queued += 1
        self._outbox.put((buffers, handle))

    def _transmit(self, buffers: Iterable, handle: Handle | None) -> None:
        try:
            send_buffers(self.sock, buffers)
        except STALLED:
            self._die(f"peer accepted no data for {self._peer_timeout_s}s")
        except OSError as e:
            self._die(f"send failed: {e}")
        self.last_sent = time.monotonic()
        if handle is not None:
            handle._finish(None if self.dead is None else f"connection lost: {self.dead}")

    def close(self, reason: str) -> None:
        self._die(reason)
        self._sender.join(1.0)
        self._receiver.join(1.0)

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            with self._send_lock:
                self._transmit(*item)
                with self._lock:
                    self._queued -= 1
        self._fail_outbox()

    def _recv_loop(self) -> None:
        try:
            while True:
                kind, req_id, length = FRAME.unpack(recv_exact(self.sock, FRAME.size))
                self.last_received = time.monotonic()
                kind = Kind(kind)
                if kind is Kind.READ_DATA:
                    # Looked up, not removed, until the payload is in: if the connection dies halfway,
                    # _die still finds this request and fails it.
                    pending = self._get(req_id)
                    if pending.views is None or length != pending.handle.nbytes:
                        raise ConnectionLost(f"READ_DATA of {length} bytes does not match request {req_id}")
                    recv_into_buffers(self.sock, pending.views)
                    drain(self.sock, pad_length(length))
                    self._complete(req_id)
                elif kind is Kind.WRITE_DONE:
                    self._complete(req_id)
                elif kind is Kind.FAILED:
                    self._complete(req_id, recv_body(self.sock, length).decode(errors="replace"))
                elif kind is Kind.NOTIFY:
                    self._on_notify(self.peer, bytes(recv_body(self.sock, length)))
                elif kind is Kind.GRANTS:
                    self._on_grants(self.peer, json.loads(recv_body(self.sock, length)))
                elif kind is Kind.PONG:
                    pass
                else:
                    raise ConnectionLost(f"unexpected {kind.name} from the server")
        except STALLED:
            self._die(f"no reply from peer for {self._peer_timeout_s}s")
        except (OSError, ValueError, KeyError) as e:
            self._die(str(e) or type(e).__name__)

    def _get(self, req_id: int) -> _Pending:
        pending = self._pending.get(req_id)
        if pending is None:
            raise ConnectionLost(f"reply to unknown request {req_id}")
        return pending

    def _complete(self, req_id: int, error: str | None = None) -> None:
        with self._lock:
            pending = self._pending.pop(req_id, None)
        if pending is None:
            raise ConnectionLost(f"reply to unknown request {req_id}")
        pending.handle._finish(error)

    def _die(self, reason: str) -> None:
        with self._lock:
            if self.dead is not None:
                return
            self.dead = reason
            pending, self._pending = list(self._pending.values()), {}
        _shutdown(self.sock)                 # wakes the other thread out of its blocking call
        for p in pending:
            p.handle._finish(f"connection lost: {reason}")
        self._outbox.put(None)
        self._on_dead(self.peer, reason)

    def _fail_outbox(self) -> None:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1] is not None:
                item[1]._finish(f"connection lost: {self.dead}")


def connect(address: tuple[str, int], timeout: float) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout)
    tune(sock, timeout)
    return sock


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

