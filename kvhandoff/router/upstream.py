"""The router's HTTP to its workers: aiohttp, on kept-alive connections, parsed in C; and the SSE events of a
streamed answer, read as they arrive.

Chosen by measurement (issue 24): a streamed POST whose answer's first line is read, from a kept-alive
client to a uvicorn worker on this machine, took 2.5-2.8 ms with httpx and 0.6 ms with aiohttp (h11
worker; 1.9-2.1 against 0.5 ms with httptools), and the router makes two or three of them per
request, each on the first token's critical path. A persistent binary channel instead (issue 46),
measured the same way on a 2-core Zen 4 (a ~1 KB body, one line back, 2,000 round trips, p50): this
path 0.48-0.55 ms, length-prefixed msgpack frames over one kept asyncio connection into the same
FastAPI app 0.31 ms, the frames alone 0.17 ms: not built yet. The rest of the router sees only this module:
`Upstream.open` returns an `Answer` (status line read, body not), and every failure is one of two
errors: `Unreachable` (the worker never saw the request) or `Broken` (it failed or hung up mid-answer).
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

import aiohttp
import msgspec

# A line of a worker's answer may carry a whole prompt's token ids (a pull handoff object, a
# stream's prompt_token_ids): readline's buffer must hold it.
READ_BUFFER = 1 << 22


class UpstreamError(Exception):
    pass


class Unreachable(UpstreamError):
    """The worker could not be reached (refused, timed out connecting): it never saw the request."""


class Broken(UpstreamError):
    """The worker's answer failed midway (it died, hung up, or took longer than allowed)."""


class Answer:
    """One worker answer, its body unread: read it whole, or line by line; `close()` hangs up on a
    half-read one (which is how a worker learns nobody listens any more) and returns a read one's
    connection to the pool."""

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
        """Each line as it arrives, with its line end; ends with the answer."""
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
    def __init__(self, connect_timeout: float, headers: dict):
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
        return Answer(resp)

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

    async def close(self) -> None:
        await self.session.close()


def describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__


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
