"""The decode worker's server-sent events, relayed to the client as they arrive.

Events before the first token (a chat stream's role announcement) are held back with it, so that a
worker failing before then can be replaced (retry.py) without the client seeing two beginnings. A
failure after it, or the deadline, ends the stream with an OpenAI error event, as a worker's own
stream would. The events that carry the handoff object (the final chunk, and the usage chunk when
asked for) are re-encoded with the merged one and the router's timings.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Awaitable, Callable

import httpx

from kvhandoff.serve import protocol as P
from kvhandoff.serve.router.attempt import Attempt, Phase, rewrite_final
from kvhandoff.serve.router.errors import Relay, deadline_error, failure_message, worker_failure
from kvhandoff.serve.router.retry import retry_elsewhere
from kvhandoff.serve.server import sse_event

log = logging.getLogger("kvhandoff.router")
DONE = "data: [DONE]\n\n"


async def relay_events(attempt: Attempt, resp: httpx.Response,
                       reopen: Callable[[Attempt], Awaitable[httpx.Response]]) -> AsyncIterator[str]:
    """The client's stream. `reopen` runs a fresh attempt after a retry on other workers."""
    events, held = sse_events(resp), []
    timeout_s = attempt.config.request_timeout
    while True:
        try:
            async with asyncio.timeout_at(attempt.deadline):
                lines = await anext(events, None)
        except TimeoutError:
            attempt.status = "504"
            log.warning("handoff %s: the stream did not end within --request-timeout %g s (%s)",
                        attempt.handoff_id, timeout_s, attempt.workers_named())
            yield "".join(held) + sse_event(deadline_error(timeout_s).body()) + DONE
            return
        except httpx.TransportError as e:
            failure = worker_failure(attempt.decode, e)
            try:
                if await retry_elsewhere(attempt, failure):
                    async with asyncio.timeout_at(attempt.deadline):
                        resp = await reopen(attempt)
                    events, held = sse_events(resp), []
                    continue
            except (Relay, P.APIError) as e2:            # the retry failed too
                failure = e2
            except TimeoutError:
                failure = deadline_error(timeout_s)
            attempt.status = str(getattr(failure, "status", 502))
            message = failure_message(failure)
            if attempt.retry_reason:
                message += f" (retried after: {attempt.retry_reason})"
            yield "".join(held) + sse_event(P.error_body(message, "server_error")) + DONE
            return
        if lines is None:
            attempt.phase = Phase.DRAINED
            attempt.open_legs.discard("decode")
            if held:
                yield "".join(held)
            return
        event = await rewrite_event(attempt, lines)
        if attempt.phase is not Phase.STREAMING and attempt.status == "200":
            held.append(event)
            continue
        yield "".join(held) + event
        held = []


async def rewrite_event(attempt: Attempt, lines: list[str]) -> str:
    raw = "\n".join(lines) + "\n\n"
    payload = lines[0][5:].strip() if len(lines) == 1 and lines[0].startswith("data:") else None
    if not payload or payload == "[DONE]":
        return raw
    try:
        chunk = json.loads(payload)
    except ValueError:
        return raw
    if not isinstance(chunk, dict):
        return raw
    if "error" in chunk:
        attempt.status = "stream_error"
    if attempt.phase is Phase.ANSWERING and has_token(chunk):
        attempt.first_token_ms = attempt.ms()
        attempt.phase = Phase.STREAMING
        attempt.router.metrics.ttft.labels(attempt.mode.value).observe(attempt.first_token_ms / 1e3)
    if attempt.retried and "timings" in chunk:       # the final chunk, or the usage chunk after it
        return sse_event(rewrite_final(attempt, chunk, attempt.retried_handoff()))
    if isinstance(chunk.get("handoff"), dict):
        return sse_event(rewrite_final(attempt, chunk, await attempt.merge(chunk["handoff"])))
    return raw


async def sse_events(resp: httpx.Response) -> AsyncIterator[list[str]]:
    """The lines of each SSE event (blank-line separated), yielded as soon as the event is complete."""
    lines: list[str] = []
    async for line in resp.aiter_lines():
        if line:
            lines.append(line)
        elif lines:
            yield lines
            lines = []
    if lines:
        yield lines


def has_token(chunk: dict) -> bool:
    """Does this completion or chat chunk carry generated text (not the role-only opening chunk)?"""
    for choice in chunk.get("choices") or ():
        if isinstance(choice, dict) and (choice.get("text") or (choice.get("delta") or {}).get("content")):
            return True
    return False
