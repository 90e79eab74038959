"""The router's connections to its workers: every leg goes over the worker's persistent channel
(channel.py, wire/channel.py) once its /health has named one, else over HTTP (aiohttp, kept-alive
connections, parsed in C); and the SSE events of a streamed answer, read as they arrive.

Chosen by measurement. Issue 24: a streamed POST whose answer's first line is read, from a kept-alive
client to a uvicorn worker on this machine, took 2.5-2.8 ms with httpx and 0.6 ms with aiohttp (h11
worker; 1.9-2.1 against 0.5 ms with httptools), and the router makes two or three of them per
request, each on the first token's critical path. Issue 46, the same way on a 2-core Zen 4 (a ~1 KB
body, one line back, 2,000 round trips, p50): this HTTP path 0.48-0.55 ms, length-prefixed msgpack
frames over one kept connection into the same FastAPI app 0.31 ms, the frames alone 0.17 ms. The rest
of the router sees only `Upstream.open`, which returns an `Answer` (answer.py) either way, and its two
errors, `Unreachable` and `Broken`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import msgspec

from kvhandoff.router.answer import READ_BUFFER, Answer, Broken, Unreachable, describe
from kvhandoff.router.channel import Channel

log = logging.getLogger("kvhandoff.router")
CHANNEL_RETRY_S = 5.0       # after a channel failed to connect, its worker's legs go over HTTP this long


class HttpAnswer(Answer):
    def __init__(self, resp: aiohttp.ClientResponse):
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.headers.get("content-type", "")
        self.retry_after = resp.headers.get("retry-after")

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise Broken(describe(e)) from None

    async def lines(self) -> AsyncIterator[bytes]:
        content = self._resp.content
        try:
            while line := await content.readline():
                yield line
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:    # ValueError: a line over the buffer
            raise Broken(describe(e)) from None

    def close(self) -> None:
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


class Upstream:
    def __init__(self, connect_timeout: float, headers: dict, token: str | None = None, channels: bool = True,
                 sent=None):
        """`headers`: sent with every HTTP request (the control token's); `token`: the control token a
        channel authenticates with (None, or `channels` False: every leg over HTTP); `sent`: a counter
        labelled by transport, of what went which way."""
        self.connect_timeout, self.token = connect_timeout, token if channels else None
        self.sent = {transport: sent.labels(transport) for transport in ("channel", "http")} if sent is not None else None
        self.channel_ports: dict[str, tuple[str, int]] = {}       # worker URL -> where its channel listens
        self.channels: dict[str, asyncio.Future] = {}              # worker URL -> its Channel (connecting or up)
        self.channel_failed: dict[str, float] = {}                 # worker URL -> when its channel last failed
        # No pool cap: in-flight requests are bounded by the workers' queues, and a router that queued
        # on its own pool would hide load from them. Idle connections are dropped well before the
        # workers would close them (wire.http.SERVER_KEEP_ALIVE_S).
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=5.0), headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout), read_bufsize=READ_BUFFER,
            max_line_size=READ_BUFFER, max_field_size=READ_BUFFER)

    async def open(self, method: str, url: str, body: dict | None = None, timeout: float | None = None,
                   headers: dict | None = None) -> Answer:
        """Send a request; returns its answer with the status line read. No read timeout unless
        given: a long prefill or generation is not a failure (the router's deadline bounds them)."""
        path_at = url.find("/", url.find("//") + 2)
        base = url[:path_at] if path_at >= 0 else url
        channel = self.channel(base) if base in self.channel_ports else None
        if channel is not None:
            payload = msgspec.json.encode(body) if body is not None else b""
            fields = [["content-type", "application/json"]] if body is not None else []
            fields += [[name, value] for name, value in (headers or {}).items()]
            if self.sent is not None:
                self.sent["channel"].inc()
            return await channel.open(method, url[len(base):], fields, payload, timeout)
        if self.sent is not None:
            self.sent["http"].inc()
        options: dict = {}
        if body is not None:
            options.update(data=msgspec.json.encode(body), headers={"content-type": "application/json", **(headers or {})})
        if timeout is not None:
            options["timeout"] = aiohttp.ClientTimeout(total=timeout, sock_connect=self.session.timeout.sock_connect)
        try:
            resp = await self.session.request(method, url, **options)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise Unreachable(describe(e)) from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise Broken(describe(e)) from None
        return HttpAnswer(resp)

    async def call(self, method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, object]:
        """A whole short exchange (health, control messages): (status, JSON body, or None if it is
        not JSON)."""
        answer = await self.open(method, url, body, timeout)
        try:
            raw = await answer.read()
        finally:
            answer.close()
        try:
            return answer.status, msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return answer.status, None

    # -- channels ---------------------------------------------------------------------------------
    # A leg never waits for a channel to connect: it goes over HTTP until one is up. A worker's channel
    # is connected when its /health names it (offer), and again after it broke, in the background.
    def offer(self, url: str, port: object) -> None:
        """What a worker's /health said of its channel (`channel_port`, or nothing): connect to it;
        a new port (the worker restarted) replaces the old connection."""
        if self.token is None:
            return
        where = (urlsplit(url).hostname, port) if isinstance(port, int) else None
        if self.channel_ports.get(url) == where:
            return
        self.drop(url)
        if where is not None:
            self.channel_ports[url] = where
            self.connect(url)

    def drop(self, url: str) -> None:
        """Forget `url`'s channel (it left the pool, or stopped offering one): its open legs break."""
        self.channel_ports.pop(url, None)
        self.channel_failed.pop(url, None)
        connecting = self.channels.pop(url, None)
        if connecting is not None:
            connecting.add_done_callback(lambda done: _connected(done) and done.result().close())

    def channel(self, url: str) -> Channel | None:
        """`url`'s channel if it is up; else None (this leg goes over HTTP), and a new connection is
        started unless one failed less than CHANNEL_RETRY_S ago."""
        connecting = self.channels.get(url)
        if connecting is not None and _connected(connecting) and not connecting.result().closed:
            return connecting.result()
        if connecting is None or connecting.done():
            if time.monotonic() - self.channel_failed.get(url, -CHANNEL_RETRY_S) >= CHANNEL_RETRY_S:
                self.connect(url)
        return None

    def connect(self, url: str) -> None:
        host, port = self.channel_ports[url]
        connecting = self.channels[url] = asyncio.ensure_future(Channel.connect(host, port, self.token, self.connect_timeout))
        connecting.add_done_callback(lambda done: self._connect_ended(url, port, done))

    def _connect_ended(self, url: str, port: int, done: asyncio.Future) -> None:
        if done.cancelled() or done.exception() is None or self.channels.get(url) is not done:
            return
        first = url not in self.channel_failed
        self.channel_failed[url] = time.monotonic()
        # Once at warning (a worker behind something that passes only its HTTP port says so at start, not
        # every few seconds); then at debug.
        log.log(logging.WARNING if first else logging.DEBUG, "%s: its channel (port %s) failed: %s; its legs go "
                "over HTTP (tried again after %.0f s)", url, port, describe(done.exception()), CHANNEL_RETRY_S)

    async def close(self) -> None:
        for url in list(self.channel_ports):
            self.drop(url)
        await self.session.close()


def _connected(connecting: asyncio.Future) -> bool:
    return connecting.done() and not connecting.cancelled() and connecting.exception() is None


async def sse_events(resp: Answer) -> AsyncIterator[list[str]]:
    """The lines of each SSE event (blank-line separated), yielded as soon as the event is complete."""
    lines: list[str] = []
    async for raw in resp.lines():
        line = raw.decode().rstrip("\r\n")
        if line:
            lines.append(line)
        elif lines:
            yield lines
            lines = []
    if lines:
        yield lines


def data_json(lines: list[str]) -> dict | None:
    """The JSON object of a one-line `data:` event, or None."""
    payload = lines[-1][5:].strip() if lines and lines[-1].startswith("data:") else None
    if not payload or payload == "[DONE]":
        return None
    try:
        chunk = json.loads(payload)
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None
