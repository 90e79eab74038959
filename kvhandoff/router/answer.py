"""A worker's answer as the router sees it, whichever way it came (HTTP: upstream.py; the persistent
channel: channel.py): its status line read, its body not; and the only two ways a leg fails,
`Unreachable` (the worker never saw the request) or `Broken` (it failed or hung up mid-answer)."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

# A line of a worker's answer may carry a whole prompt's token ids (a pull handoff object, a
# stream's prompt_token_ids): a line reader must hold it.
READ_BUFFER = 1 << 22


class UpstreamError(Exception):
    pass


class Unreachable(UpstreamError):
    """The worker could not be reached (refused, timed out connecting): it never saw the request."""


class Broken(UpstreamError):
    """The worker's answer failed midway (it died, hung up, or took longer than allowed)."""


class Answer:
    """One worker answer, its body unread: read it whole, or line by line; `close()` hangs up on a
    half-read one (which is how a worker learns nobody listens any more) and frees a read one."""
    status: int
    content_type: str
    retry_after: str | None

    async def read(self) -> bytes:
        raise NotImplementedError

    def lines(self) -> AsyncIterator[bytes]:
        """Each line as it arrives, with its line end; ends with the answer."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__
