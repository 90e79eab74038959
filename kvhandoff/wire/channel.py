"""The persistent channel between a router and a worker (issue 46): every leg the router opens to a
worker, as length-prefixed msgpack frames over one kept TCP connection, instead of an HTTP request.

Why: a leg is an HTTP request whose answer's first line is on a client's first-token path. Measured on a
2-core Zen 4 (a ~1 KB body, one line back, p50 of 2,000): aiohttp to uvicorn, kept alive, 0.48-0.55
ms; these frames dispatched into the same FastAPI app 0.31 ms. The frames carry an HTTP exchange, so
the worker's app, its routes, errors, authentication and streaming answers are the same either way,
and so is what the router sees (router/channel.py gives it the same `Answer` as HTTP does).

One connection per router and worker, authenticated once: the router's first frame is HELLO with the
deployment's control token (wire/auth.py), checked in constant time; only then are legs taken, each
seen by the app as carrying that token. A worker without a deployment secret offers no channel.

Frames, each `[kind, leg, ...]` (legs are numbered by the router, per connection):
    router -> worker   HELLO [version, token]   OPEN [leg, method, path, headers, body]
                       CANCEL [leg] (the router stopped listening: the app sees http.disconnect)
                       CREDIT [leg, bytes] (the router took that much of the leg's answer)
    worker -> router   READY [version] | REFUSED [why], then it hangs up
                       START [leg, status, headers]   DATA [leg, bytes]   END [leg, error or None]
A leg's answer stops after WINDOW bytes the router has not taken, so a slow client holds back only
its own stream, as TCP does for an HTTP one. A dead connection ends every leg on it: the app sees
its client gone, the router a broken answer.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import struct
from enum import IntEnum
from typing import Callable

import msgspec

from kvhandoff.wire.auth import control_token

log = logging.getLogger("kvhandoff.channel")

VERSION = 1
LENGTH = struct.Struct("!I")
MAX_FRAME = 1 << 30             # a leg's body or line can hold a whole prompt's token ids
HELLO_MAX_FRAME = 1 << 12       # before authentication, nothing larger is read
HELLO_TIMEOUT_S = 10.0
WINDOW = 1 << 20                # bytes of one leg's answer sent and not yet taken by the router


class Kind(IntEnum):
    HELLO, READY, REFUSED, OPEN, CANCEL, CREDIT, START, DATA, END = range(9)


class FrameError(Exception):
    """A peer sent something that is not a frame of this protocol."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class Framed(asyncio.Protocol):
    """One end of a connection: frames out (`send`, `drain` for backpressure) and in (`on_frame`)."""

    def __init__(self, max_frame: int):
        self.max_frame = max_frame
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._writable: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start, frames = 0, []
        while len(buffer) - start >= LENGTH.size:
            (size,) = LENGTH.unpack_from(buffer, start)
            if size > self.max_frame:
                return self.fail(f"a frame of {size} bytes (at most {self.max_frame})")
            end = start + LENGTH.size + size
            if len(buffer) < end:
                break
            try:
                frame = _decode(memoryview(buffer)[start + LENGTH.size:end])
            except msgspec.DecodeError as e:
                return self.fail(f"a frame that is not msgpack: {e}")
            frames.append(frame)
            start = end
        if start:
            del buffer[:start]
        for frame in frames:
            if self.closed:
                return
            if not isinstance(frame, list) or not frame or not isinstance(frame[0], int):
                return self.fail("a frame that is not [kind, ...]")
            try:
                self.on_frame(frame)
            except (FrameError, ValueError, TypeError, IndexError) as e:
                return self.fail(f"a malformed frame {Kind(frame[0]).name if 0 <= frame[0] < len(Kind) else frame[0]}: {e}")

    def on_frame(self, frame: list) -> None:
        raise NotImplementedError

    def send(self, frame: tuple) -> None:
        if self.closed:
            return
        payload = _encode(frame)
        self.transport.write(LENGTH.pack(len(payload)) + payload)

    @property
    def paused(self) -> bool:
        """Over the send buffer's high-water mark (`drain` waits)."""
        return self._writable is not None and not self.closed

    async def drain(self) -> None:
        """Wait while the connection's send buffer is over its high-water mark."""
        if self.paused:
            await asyncio.shield(self._writable)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def fail(self, why: str) -> None:
        log.warning("channel peer %s sent %s; hanging up", self.peer, why)
        self.transport.close()

    @property
    def peer(self) -> str:
        name = self.transport.get_extra_info("peername") if self.transport is not None else None
        return f"{name[0]}:{name[1]}" if name else "?"

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.resume_writing()


# -- the worker's end ----------------------------------------------------------------------------------
class ChannelServer:
    """The worker's listener: serves `app` (an ASGI app) to routers holding `secret`'s control token."""

    def __init__(self, app, secret: bytes):
        assert secret, "a worker without a deployment secret offers no channel"
        self.app = app
        self.token = control_token(secret).encode()
        self.server: asyncio.Server | None = None
        self.connections: set[ServerConnection] = set()

    async def start(self, host: str) -> int:
        """Listen on `host` (the worker's own HTTP host), on a free port; returns it."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: ServerConnection(self), host, 0)
        return self.server.sockets[0].getsockname()[1]

    def close(self) -> None:
        """Stop listening and hang up on every router: their legs end as if the worker had died."""
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.transport.close()


class ServerConnection(Framed):
    def __init__(self, server: ChannelServer):
        super().__init__(HELLO_MAX_FRAME)
        self.server = server
        self.legs: dict[int, ServerLeg] = {}
        self.authenticated = False
        self.hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.server.connections.add(self)
        self.hello_timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self.refuse, "no HELLO in time")

    def refuse(self, why: str) -> None:
        log.warning("channel: refused %s: %s", self.peer, why)       # (never the token it sent)
        self.send((Kind.REFUSED, why))
        self.transport.close()

    def on_frame(self, frame: list) -> None:
        kind = frame[0]
        if not self.authenticated:
            self.hello_timer.cancel()
            if kind != Kind.HELLO or len(frame) != 3 or not isinstance(frame[2], str):
                return self.refuse("the first frame was not HELLO [version, token]")
            if frame[1] != VERSION:
                return self.refuse(f"channel version {frame[1]!r}; this worker speaks {VERSION}")
            if not hmac.compare_digest(frame[2].encode(), self.server.token):
                return self.refuse("wrong control token (is the router started with this deployment's --kv-secret?)")
            self.authenticated, self.max_frame = True, MAX_FRAME
            self.send((Kind.READY, VERSION))
            return
        if kind == Kind.OPEN:
            _, leg_id, method, path, headers, body = frame
            if leg_id in self.legs:
                raise FrameError(f"leg {leg_id} is already open")
            if not (isinstance(method, str) and isinstance(path, str) and path.startswith("/") and isinstance(body, bytes)
                    and all(isinstance(name, str) and isinstance(value, str) for name, value in headers)):
                raise FrameError("OPEN [leg, method, path, [[name, value], ...], body bytes]")
            leg = self.legs[leg_id] = ServerLeg(self, leg_id, self.scope(method, path, headers), body)
            leg.task = asyncio.get_running_loop().create_task(leg.run(self.server.app))   # (held: the loop keeps a weak one)
        elif kind == Kind.CANCEL:
            if (leg := self.legs.get(frame[1])) is not None:
                leg.disconnect()
        elif kind == Kind.CREDIT:
            if (leg := self.legs.get(frame[1])) is not None:
                leg.credit(int(frame[2]))
        else:
            raise FrameError("not a frame a router sends")

    def scope(self, method: str, path: str, headers: list) -> dict:
        path, _, query = path.partition("?")
        # The connection is authenticated: every leg carries its control token, as an HTTP one would.
        headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers
                   if name.lower() != "authorization"]
        headers.append((b"authorization", b"Bearer " + self.server.token))
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                "query_string": query.encode(), "headers": headers, "state": {},
                "server": self.transport.get_extra_info("sockname")[:2],
                "client": self.transport.get_extra_info("peername")[:2]}

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        self.server.connections.discard(self)
        for leg in list(self.legs.values()):
            leg.disconnect()


class ServerLeg:
    """One leg as the app sees it: an HTTP request whose body is all here, answered through frames."""

    def __init__(self, connection: ServerConnection, leg_id: int, scope: dict, body: bytes):
        self.connection, self.leg_id, self.scope = connection, leg_id, scope
        self.body: bytes | None = body
        self.gone = asyncio.Event()              # the router stopped listening, or the connection died
        self.wakeup = asyncio.Event()            # credit came, or the router is gone
        self.unacked = 0                         # answer bytes sent the router has not taken
        self.started = self.ended = False
        self.task: asyncio.Task | None = None

    async def receive(self) -> dict:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.gone.is_set():
            return          # nobody listens (what uvicorn does for a client gone)
        connection = self.connection
        if message["type"] == "http.response.start":
            self.started = True
            connection.send((Kind.START, self.leg_id, message["status"], message.get("headers", [])))
            return
        if message["type"] != "http.response.body":
            return
        body = message.get("body", b"")
        if body:
            while self.unacked >= WINDOW and not self.gone.is_set():
                self.wakeup.clear()
                await self.wakeup.wait()
            if self.gone.is_set():
                return
            self.unacked += len(body)
            connection.send((Kind.DATA, self.leg_id, body))
        if not message.get("more_body", False):
            self.ended = True
            connection.send((Kind.END, self.leg_id, None))
        if connection.paused:       # (a token's event: no coroutine to wait on when there is room)
            await connection.drain()

    def credit(self, taken: int) -> None:
        self.unacked = max(0, self.unacked - taken)
        self.wakeup.set()

    def disconnect(self) -> None:
        self.gone.set()
        self.wakeup.set()

    async def run(self, app: Callable) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except Exception as e:
            log.exception("channel leg %s %s failed", self.scope["method"], self.scope["path"])
            self.fail(str(e) or type(e).__name__)
        except asyncio.CancelledError:
            self.fail("the worker is shutting down")
            raise
        else:
            if not self.ended:
                self.fail("the worker's app returned without finishing its answer")
        finally:
            self.connection.legs.pop(self.leg_id, None)

    def fail(self, why: str) -> None:
        if self.ended or self.gone.is_set():
            return
        self.ended = True
        if not self.started:        # (as uvicorn answers an app that failed before its answer began)
            self.connection.send((Kind.START, self.leg_id, 500, [(b"content-type", b"text/plain")]))
            self.connection.send((Kind.DATA, self.leg_id, b"Internal Server Error"))
            self.connection.send((Kind.END, self.leg_id, None))
            return
        self.connection.send((Kind.END, self.leg_id, why))
