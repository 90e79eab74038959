"""The wire between two agents: frames, the authenticated handshake, descriptor tables, and the
scatter/gather socket I/O that moves payloads without intermediate copies.

After the handshake, every frame is a 64-byte header (kind, request id, body length, then zeros) and
a body zero-padded to a multiple of 64 bytes. READ/WRITE bodies are (descriptor count, notification
length), the descriptor table, the notification; a WRITE's payload follows its body, a READ's comes
back after a READ_DATA header, each padded the same way. Control bodies are small JSON.

Why 64: the kernel copies a send into its socket pages at the offset the bytes before it in that send
left, and receives out of them into ours. With a 16-byte header before a payload, every one of those
copies ran 16 bytes out of step with the page-aligned blocks on both sides, and on a 2-core AVX2 EPYC
VM a raw loopback stream of 64 MiB in 256 KiB blocks took 60 ms behind a 16-byte prefix and 23-27 ms
behind none or a 64-byte one (bench-transfer --pin, the same-memory stream). So every byte an agent
sends is a whole number of 64-byte lines, and every payload starts on one. The handshake's frames
keep the 16-byte header of version 1, so a peer of another version is refused in words.

Handshake (client C connects to server S; both hold the shared secret K):
    C -> S  HELLO      {name, nonce_c}
    S -> C  CHALLENGE  {name, nonce_s, mac = HMAC(K, "kvh-server" | nonce_c | nonce_s | S | C)}
    C -> S  AUTH       {mac = HMAC(K, "kvh-client" | nonce_s | nonce_c | C | S)}
    S -> C  WELCOME    {grants...}   or REFUSED {reason}
Each side proves knowledge of K over the other's fresh nonce, and the labels differ, so neither
answer can be replayed or reflected. The secret itself never crosses the wire.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import socket
import itertools
import struct
from collections.abc import Iterable, Iterator
from enum import IntEnum

import numpy as np

FRAME = struct.Struct("<B3xIQ48x")       # kind, request id, body length, zeros up to ALIGN
HELLO_FRAME = struct.Struct("<B3xIQ")    # the handshake's frames
ALIGN = 64                               # every frame, body and payload starts on a multiple of this
XFER = struct.Struct("<II")              # descriptor count, notification length
DESC = np.dtype([("region", "<u4"), ("pad", "<u4"), ("offset", "<u8"), ("length", "<u8")])
MAX_PREAUTH_BODY = 64 << 10              # nothing big is accepted from a peer not yet authenticated
MAX_BODY = 256 << 20                     # descriptor tables and notifications after the handshake
IOV_MAX = 1024                           # Linux's limit on buffers per sendmsg/recvmsg
LARGE_RECV = 64 * 1024                   # a buffer this big is received alone (recv_into), see recv_into_buffers
RECV_BUFFERS = 256                       # buffers offered per recvmsg_into: more than one call fills
HANDSHAKE_VERSION = 2              # 2: frames aligned to 64 bytes after the handshake


class Kind(IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    REFUSED = 5
    READ = 10           # body: XFER + descriptors + notification; answered by READ_DATA or FAILED
    WRITE = 11          # body: XFER + descriptors + notification, then the payload; WRITE_DONE or FAILED
    READ_DATA = 12      # body: the payload
    WRITE_DONE = 13
    FAILED = 14         # body: utf-8 reason
    NOTIFY = 20         # body: the notification
    GRANTS = 21         # body: JSON grant table (the server's registered regions changed)
    PING = 22
    PONG = 23


class ConnectionLost(ConnectionError):
    pass


def mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, label, hashlib.sha256)
    for part in parts:                   # length-prefixed, so ("ab", "c") and ("a", "bc") differ
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return h.digest()


def pad_length(n: int) -> int:
    """How many zeros follow `n` bytes of body or payload, up to the next multiple of ALIGN."""
    return -n % ALIGN


def padding(n: int) -> bytes:
    return bytes(pad_length(n))


def frame(kind: Kind, req_id: int = 0, body: bytes = b"") -> bytes:
    return FRAME.pack(kind, req_id, len(body)) + body + padding(len(body))


def json_frame(kind: Kind, obj: dict, req_id: int = 0) -> bytes:
    return frame(kind, req_id, json.dumps(obj, separators=(",", ":")).encode())


def hello_frame(kind: Kind, obj: dict) -> bytes:
    """A handshake frame: 16-byte header, JSON body, no padding (as in version 1)."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    return HELLO_FRAME.pack(kind, 0, len(body)) + body


def xfer_body(regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, notify: bytes) -> bytes:
    table = np.zeros(regions.size, dtype=DESC)
    table["region"], table["offset"], table["length"] = regions, offsets, lengths
    return XFER.pack(regions.size, len(notify)) + table.tobytes() + notify


def parse_xfer_body(body: bytes | bytearray) -> tuple[np.ndarray, bytes]:
    count, notify_len = XFER.unpack_from(body)
    end = XFER.size + count * DESC.itemsize
    if count == 0 or end + notify_len != len(body):
        raise ValueError("malformed transfer request")
    return np.frombuffer(body, dtype=DESC, count=count, offset=XFER.size), bytes(body[end:])


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_filling(sock, memoryview(buf))
    return buf


def recv_filling(sock: socket.socket, view: memoryview) -> None:
    """Receive until `view` is full."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionLost("connection closed by peer")
        got += k


def recv_frame(sock: socket.socket, max_body: int = MAX_BODY) -> tuple[Kind, int, bytearray]:
    kind, req_id, length = FRAME.unpack(recv_exact(sock, FRAME.size))
    if length > max_body:
        raise ConnectionLost(f"frame body of {length} bytes exceeds the limit of {max_body}")
    return Kind(kind), req_id, recv_body(sock, length)


def recv_body(sock: socket.socket, length: int) -> bytearray:
    """A frame's `length`-byte body, its padding received and dropped."""
    body = recv_exact(sock, length + pad_length(length))
    del body[length:]
    return body


def recv_hello_frame(sock: socket.socket, max_body: int = MAX_PREAUTH_BODY) -> tuple[Kind, bytearray]:
    kind, _, length = HELLO_FRAME.unpack(recv_exact(sock, HELLO_FRAME.size))
    if length > max_body:
        raise ConnectionLost(f"frame body of {length} bytes exceeds the limit of {max_body}")
    return Kind(kind), recv_exact(sock, length)


def send_buffers(sock: socket.socket, buffers: Iterable) -> None:
    """Gather-send every buffer in order (bytes or 1-D byte memoryviews), IOV_MAX at a time.

    `buffers` may be a generator: views are made just ahead of the socket, so a transfer of
    thousands of blocks starts moving bytes at once instead of after building them all.
    """
    pending, rest = iter(buffers), []
    while True:
        if len(rest) < IOV_MAX:
            rest += itertools.islice(pending, IOV_MAX - len(rest))
        if not rest:
            return
        rest = _advance(rest, sock.sendmsg(rest))


def send_nowait(sock: socket.socket, buffers: list) -> list:
    """Send what the socket takes without blocking; returns the unsent tail ([] when all went out)."""
    rest = list(buffers)
    try:
        while rest:
            rest = _advance(rest, sock.sendmsg(rest[:IOV_MAX], [], socket.MSG_DONTWAIT))
    except BlockingIOError:
        pass
    return rest


def _advance(bufs: list, sent: int) -> list:
    """The buffers still to send after `sent` more bytes went out (a partial one is re-sliced)."""
    i = 0
    while sent:
        n = len(bufs[i])
        if sent < n:
            return [memoryview(bufs[i])[sent:], *bufs[i + 1:]]
        sent -= n
        i += 1
    while i < len(bufs) and not len(bufs[i]):      # empty buffers (no padding due) are done already
        i += 1
    return bufs[i:]


def recv_into_buffers(sock: socket.socket, buffers: Iterable[memoryview]) -> None:
    """Scatter-receive exactly as many bytes as the buffers hold, straight into them (a generator
    of buffers is consumed just ahead of the socket, like in send_buffers).

    Small buffers go many to a recvmsg_into; a large one (LARGE_RECV) alone, with recv_into: a
    recvmsg_into builds its whole iovec array again on every call, and loopback hands over a socket
    buffer's worth per call, so a window of 256 KiB blocks cost more in set-up than one recv_into
    per block. tcp read x a contiguous raw stream, medians of 6 alternated bench-transfer runs on a
    2-core Zen 4 VM: 256 KiB blocks 0.84 -> 0.95, 4 MiB 0.81 -> 0.89."""
    pending, window = iter(buffers), []
    while True:
        if len(window) < RECV_BUFFERS:
            window += itertools.islice(pending, RECV_BUFFERS - len(window))
        if not window:
            return
        if len(window[0]) >= LARGE_RECV:
            recv_filling(sock, memoryview(window[0]))
            window = window[1:]
            continue
        got = sock.recvmsg_into(window)[0]
        if got == 0:
            raise ConnectionLost("connection closed by peer")
        window = _advance(window, got)


def byte_views(arrays: list[memoryview], region: np.ndarray, offset: np.ndarray, length: np.ndarray) -> Iterator[memoryview]:
    """Lazily, the view of each (region index, offset, length) segment into `arrays`."""
    for r, o, n in zip(region.tolist(), offset.tolist(), length.tolist()):
        yield arrays[r][o:o + n]


def drain(sock: socket.socket, n: int) -> None:
    """Read and discard n bytes (a refused WRITE's payload, a payload's padding), keeping the stream in step."""
    if n == 0:
        return
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n:
        k = sock.recv_into(scratch[:min(n, len(scratch))])
        if k == 0:
            raise ConnectionLost("connection closed by peer")
        n -= k


# A socket that moved no byte for its timeout raises one of these (see set_timeout).
STALLED = (TimeoutError, BlockingIOError)


def tune(sock: socket.socket, timeout: float | None) -> None:
    # NODELAY: a 4 KiB READ request must leave now, not wait for Nagle. Buffer sizes stay with the
    # kernel's autotuning, which measured at least as fast on loopback as fixed 4 MiB buffers.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    set_timeout(sock, timeout)


def set_timeout(sock: socket.socket, timeout: float | None) -> None:
    """Give up on a peer that moves no byte for `timeout` seconds, without Python's socket timeouts.

    settimeout() would make the socket non-blocking and poll() before every call: a 64 MiB sendmsg
    would return after each socket-buffer's worth. SO_RCVTIMEO/SO_SNDTIMEO keep one blocking syscall
    per call and still bound every wait; a call that times out raises BlockingIOError (EAGAIN).
    """
    sock.settimeout(None)
    sec = 0.0 if timeout is None else timeout
    tv = struct.pack("@ll", int(sec), int((sec - int(sec)) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
