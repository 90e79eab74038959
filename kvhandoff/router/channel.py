"""The router's end of a worker's persistent channel (wire/channel.py has the frames and the worker's
end): one authenticated connection per worker, set up once, that carries every leg to it as frames,
each answered as the same `Answer` an HTTP leg gives (answer.py). upstream.py decides which way a
leg goes."""
from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import AsyncIterator

from kvhandoff.router.answer import READ_BUFFER, Answer, Broken
from kvhandoff.wire.channel import HELLO_MAX_FRAME, MAX_FRAME, VERSION, WINDOW, Framed, FrameError, Kind


class ChannelRefused(Exception):
    """The worker would not take this router's channel (wrong token, another version): its reason."""


class Channel(Framed):
    """One connection to one worker, and the legs open on it."""

    def __init__(self, token: str):
        super().__init__(HELLO_MAX_FRAME)
        self.token = token
        self.legs: dict[int, ClientLeg] = {}
        self.leg_ids = itertools.count(1)
        self.ready = asyncio.get_running_loop().create_future()
        self.lost_because = "the worker's channel closed"

    @classmethod
    async def connect(cls, host: str, port: int, token: str, timeout: float) -> "Channel":
        """Connect and authenticate. Raises OSError or TimeoutError (could not connect), or
        ChannelRefused (the worker said no, and why)."""
        loop = asyncio.get_running_loop()
        _, channel = await asyncio.wait_for(loop.create_connection(lambda: cls(token), host, port), timeout)
        channel.send((Kind.HELLO, VERSION, token))
        try:
            await asyncio.wait_for(asyncio.shield(channel.ready), timeout)
        except BaseException:
            channel.transport.close()
            raise
        return channel

    async def open(self, method: str, path: str, headers: list, body: bytes, timeout: float | None) -> "ChannelAnswer":
        """Send one leg; returns its answer once its status is here (Broken if the connection dies or
        `timeout`, the whole exchange's, runs out first)."""
        if self.closed:
            raise Broken(self.lost_because)
        leg = ClientLeg(self, next(self.leg_ids), timeout)
        self.legs[leg.leg_id] = leg
        self.send((Kind.OPEN, leg.leg_id, method, path, headers, body))
        try:
            await self.drain()
            status, response_headers = await leg.wait(leg.started)
        except BaseException:
            leg.close()         # (cancelled, or timed out: the worker's app sees its client gone)
            raise
        return ChannelAnswer(leg, status, response_headers)

    def on_frame(self, frame: list) -> None:
        kind = frame[0]
        if kind == Kind.READY:
            self.max_frame = MAX_FRAME
            if not self.ready.done():
                self.ready.set_result(None)
            return
        if kind == Kind.REFUSED:
            if not self.ready.done():
                self.ready.set_exception(ChannelRefused(str(frame[1])))
            self.transport.close()
            return
        leg = self.legs.get(frame[1])
        if leg is None:
            return          # (a leg this router closed: what was in flight for it is dropped)
        if kind == Kind.START:
            if not leg.started.done():
                leg.started.set_result((frame[2], frame[3]))
        elif kind == Kind.DATA:
            leg.arrived(frame[2])
        elif kind == Kind.END:
            del self.legs[leg.leg_id]
            leg.finish(frame[2])
        else:
            raise FrameError("not a frame a worker sends")

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        if exc is not None:
            self.lost_because = f"the worker's channel broke: {exc}"
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(self.lost_because))
        for leg in list(self.legs.values()):
            leg.finish(self.lost_because)
        self.legs.clear()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class ClientLeg:
    """One leg's answer as it arrives: its status, then its chunks, then its end (or why it broke)."""

    def __init__(self, channel: Channel, leg_id: int, timeout: float | None):
        loop = asyncio.get_running_loop()
        self.channel, self.leg_id = channel, leg_id
        self.deadline = loop.time() + timeout if timeout is not None else None
        self.started: asyncio.Future = loop.create_future()
        self.chunks: deque[bytes] = deque()
        self.waiter: asyncio.Future | None = None
        self.ended = False
        self.error: str | None = None
        self.taken = 0                  # bytes handed on and not yet credited to the worker

    async def wait(self, future: asyncio.Future):
        remaining = None if self.deadline is None else self.deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(asyncio.shield(future), remaining) if remaining is not None else await future
        except asyncio.TimeoutError:
            self.close()        # (the worker's app sees its client gone, as when HTTP's timeout hangs up)
            raise Broken("timed out") from None

    def arrived(self, data: bytes) -> None:
        self.chunks.append(data)
        self._wake()

    def finish(self, error: str | None) -> None:
        self.ended, self.error = True, error
        if not self.started.done():
            self.started.set_exception(Broken(error or "the worker ended a leg it never answered"))
            self.started.exception()        # (retrieved: a leg closed before its start is not an error to log)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next_chunk(self) -> bytes | None:
        """The next chunk of the answer, None at its end; Broken if it broke."""
        while not self.chunks:
            if self.ended:
                if self.error is not None:
                    raise Broken(self.error)
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            await self.wait(self.waiter)
        chunk = self.chunks.popleft()
        self.taken += len(chunk)
        if self.taken >= WINDOW // 2 and not self.ended:
            self.channel.send((Kind.CREDIT, self.leg_id, self.taken))
            self.taken = 0
        return chunk

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.channel.legs.pop(self.leg_id, None)
            self.channel.send((Kind.CANCEL, self.leg_id))
        self.chunks.clear()


class ChannelAnswer(Answer):
    def __init__(self, leg: ClientLeg, status: int, headers: list):
        self.leg, self.status = leg, status
        fields = {bytes(name).decode("latin-1").lower(): bytes(value).decode("latin-1") for name, value in headers}
        self.content_type = fields.get("content-type", "")
        self.retry_after = fields.get("retry-after")

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.leg.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def lines(self) -> AsyncIterator[bytes]:
        pending = b""
        while (chunk := await self.leg.next_chunk()) is not None:
            pending += chunk
            start = 0
            while (end := pending.find(b"\n", start)) >= 0:
                yield pending[start:end + 1]
                start = end + 1
            pending = pending[start:]
            if len(pending) > READ_BUFFER:
                self.close()
                raise Broken(f"a line of the answer is over {READ_BUFFER} bytes")
        if pending:
            yield pending

    def close(self) -> None:
        self.leg.close()
