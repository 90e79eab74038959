"""The client's stream: the prefill's first token the moment it is here, then the decode worker's
events as they arrive, and a stream that outlives its decode worker.

A decode worker marks every event for us (messages.EventNote): the token ids in it, the text sent
so far, and tags. The chunks the prefill's first token already covered (`head`: a chat stream's role
chunk; `first`: the first token's) are dropped; the events that carry the handoff object (`final`:
the last chunk, and the usage chunk) are re-encoded with the merged one and the router's timings;
the rest pass through unparsed. Before the first token a decode worker's events are held back, so
that a worker failing before then can be replaced (retry.py) without the client seeing two
beginnings. After it, a decode worker that fails (dies, breaks the stream, sends an error event) is
migrated from: the request continues on another decode worker from the prompt and the tokens sent
(Attempt.resume_on), up to --migration-limit times; only when none can, or the deadline passed, the
stream ends with an OpenAI error event, as a worker's own stream would. (A worker that sends no
notes, such as the tests' fakes, is relayed as it streams, without migration.)
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from kvhandoff.router.answer import UpstreamError
from kvhandoff.router.attempt import Attempt, Phase, rewrite_final
from kvhandoff.router.errors import Relay, WorkerFailure, deadline_error, failure_message, stream_error, worker_failure
from kvhandoff.router.retry import retry_elsewhere
from kvhandoff.router.upstream import data_json
from kvhandoff.wire import api as P
from kvhandoff.wire import messages as M
from kvhandoff.wire.http import sse_event
from kvhandoff.wire.modes import Role

log = logging.getLogger("kvhandoff.router")
DONE = "data: [DONE]\n\n"
FAILURES = (Relay, P.APIError)


@dataclass
class Sent:
    """What the client has of the answer: enough to continue it elsewhere."""
    token_ids: list[int] = field(default_factory=list)
    chars: int = 0                      # characters of text
    first_id: int | None = None         # the first token, once sent (by the prefill's answer or a decode worker)
    head: bool = False                  # the stream's beginning (a chat stream's role chunk)
    followed: bool = True               # every event so far carried a note: the tokens are known


class Deadline:
    """The router's deadline over one stream's waits on its workers, one timer for the whole stream
    (an asyncio.timeout around each event cost ~15 us of the router's CPU, 19 times a request: a tenth
    of what routing a streamed request costs). The timer cancels the stream's task only while it
    waits on a worker (`waiting`), never while it writes to the client; a wait begun after it fired
    ends at once."""

    def __init__(self, when: float):
        self.task = asyncio.current_task()
        self.waiting = self.expired = False
        self.timer = asyncio.get_running_loop().call_at(when, self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self.waiting:
            self.task.cancel()

    def begin(self) -> None:
        if self.expired:
            raise TimeoutError
        self.waiting = True

    def fired(self) -> bool:
        """After a CancelledError in a wait: was it this deadline's (and no other cancel pending)?"""
        return self.expired and self.task.uncancel() == 0

    def close(self) -> None:
        self.timer.cancel()


class Follow:
    """One client stream across the attempt's decode answers (a retry's, a migration's)."""

    def __init__(self, attempt: Attempt, reopen: Callable[[Attempt], Awaitable[None]]):
        self.attempt, self.reopen = attempt, reopen
        self.sent = Sent()
        self.held: list[str] = []       # decode events before the client's first token
        self.events: AsyncIterator[list[str]] | None = None
        self.pending: asyncio.Task | None = None        # the decode event being read
        self.first_done = False         # this attempt's first token from the prefill: handled

    async def run(self) -> AsyncIterator[str]:
        attempt, timeout_s = self.attempt, self.attempt.config.request_timeout
        deadline = Deadline(attempt.deadline)
        try:
            while True:
                try:
                    try:
                        deadline.begin()
                        kind, item = await self.next()
                        text = await self.handle(kind, item)
                    except asyncio.CancelledError:
                        if not deadline.fired():
                            raise
                        raise TimeoutError from None
                    finally:
                        deadline.waiting = False
                except TimeoutError:
                    attempt.status = "504"
                    log.warning("handoff %s: the stream did not end within --request-timeout %g s (%s)",
                                attempt.handoff_id, timeout_s, attempt.workers_named())
                    yield self.flush() + sse_event(deadline_error(timeout_s).body()) + DONE
                    return
                except (UpstreamError, *FAILURES) as exc:
                    failure = worker_failure(attempt.decode, exc) if isinstance(exc, UpstreamError) else exc
                    failure = await self.recover(attempt.blame(failure))
                    if failure is None:
                        continue
                    attempt.status = str(getattr(failure, "status", 502))
                    message = failure_message(failure)
                    if attempt.retry_reason:
                        message += f" (retried after: {attempt.retry_reason})"
                    yield self.flush() + sse_event(stream_error(failure, message)) + DONE
                    return
                if kind == "end":
                    attempt.phase = Phase.DRAINED
                    attempt.open_legs.discard(Role.DECODE)
                    if self.held:
                        yield self.flush()
                    return
                if text:
                    yield text
                if kind == "first":
                    attempt.first_relayed.set()
        finally:
            deadline.close()
            attempt.first_relayed.set()
            if self.pending is not None:
                self.pending.cancel()

    # -- reading --------------------------------------------------------------------------------------
    async def next(self) -> tuple[str, object]:
        """("first", FirstToken) from the prefill's answer, ("event", lines) from the decode
        worker's, or ("end", None). Until the prefill's first token is here, both are watched."""
        attempt = self.attempt
        while not self.first_done:
            if self.events is None and attempt.decode_task.done():
                self.events = attempt.events(attempt.decode_task.result())      # (raises what failed it)
            if self.events is not None and self.pending is None:
                self.pending = asyncio.ensure_future(anext(self.events, None))
            await asyncio.wait({attempt.first_token, self.pending or attempt.decode_task},
                               return_when=asyncio.FIRST_COMPLETED)
            if attempt.first_token.done():
                self.first_done = True
                if (first := attempt.first_token.result()) is not None:
                    return "first", first
            elif self.pending is not None and self.pending.done():
                break
        if self.events is None:
            self.events = attempt.events(await attempt.decode_task)
        if self.pending is not None:
            pending, self.pending = self.pending, None
            lines = await pending
        else:
            lines = await anext(self.events, None)
        return ("end", None) if lines is None else ("event", lines)

    # -- what the client gets -------------------------------------------------------------------------
    async def handle(self, kind: str, item) -> str:
        if kind == "first":
            return self.prefill_first(item)
        if kind == "end":
            return ""
        note = M.EventNote.parse(item[0])
        if note is None:
            self.sent.followed = False
            return await self.unnoted(item)
        data = "\n".join(item[1:]) + "\n\n"
        tags = note.tags
        if "head" in tags:
            if not self.sent.head:
                self.held.append(data)
            return ""
        if "error" in tags:
            if self.attempt.first_sent:       # the client has tokens: continue elsewhere
                raise WorkerFailure(self.attempt.decode, f"the {self.attempt.decode} failed the stream: "
                                    f"{error_message(data)}", "worker_failed")
            self.attempt.status = "stream_error"
            return self.flush() + data
        if "first" in tags and self.sent.first_id is not None:
            if note.ids[:1] == [self.sent.first_id]:
                return ""               # the prefill's first token, which the client has
            raise WorkerFailure(self.attempt.decode, f"the {self.attempt.decode} generated another first token "
                                f"({note.ids[:1]}) than the one sent ({self.sent.first_id})", "first_token_differs")
        self.sent.token_ids += note.ids
        self.sent.chars = note.chars
        if "first" in tags and note.ids:
            self.sent.first_id = note.ids[0]
        if "final" in tags:
            data = await self.final(item[1:])
        if note.ids and not self.attempt.first_sent:
            self.mark_first(from_prefill=False)
        if self.attempt.first_sent or "final" in tags:
            return self.flush() + data
        self.held.append(data)
        return ""

    def prefill_first(self, first: M.FirstToken) -> str:
        """The prefill's first token: to the client at once, unless a decode worker was quicker, or
        the detokenizer holds its text back (then the decode worker sends it with the next)."""
        if self.attempt.first_sent or not first.text:
            return ""
        self.sent.head, self.sent.first_id = True, first.token_id
        self.sent.token_ids.append(first.token_id)
        self.sent.chars += len(first.text)
        self.held = []                  # (its `sse` begins with its own head)
        self.mark_first(from_prefill=True)
        return first.sse

    def mark_first(self, from_prefill: bool) -> None:
        attempt = self.attempt
        attempt.first_token_ms, attempt.first_from_prefill = attempt.ms(), from_prefill
        attempt.phase = Phase.STREAMING
        self.sent.head = True
        metrics = attempt.router.metrics
        metrics.child(metrics.ttft, attempt.mode.value).observe(attempt.first_token_ms / 1e3)

    def flush(self) -> str:
        held, self.held = "".join(self.held), []
        return held

    async def final(self, lines: list[str]) -> str:
        """A final event, re-encoded with the merged handoff object and the router's timings."""
        chunk = data_json(lines)
        if chunk is None:
            return "\n".join(lines) + "\n\n"
        attempt = self.attempt
        if attempt.retried and "timings" in chunk:
            return sse_event(rewrite_final(attempt, chunk, attempt.retried_handoff()))
        if isinstance(chunk.get("handoff"), dict) or (attempt.migrations and "timings" in chunk):
            return sse_event(rewrite_final(attempt, chunk, await attempt.merge(chunk.get("handoff") or {})))
        return sse_event(chunk)

    async def unnoted(self, lines: list[str]) -> str:
        """An event without a note (a worker that sends none): relayed as it comes, held back until
        the first token."""
        attempt = self.attempt
        chunk = data_json(lines)
        raw = "\n".join(lines) + "\n\n"
        if chunk is not None:
            if "error" in chunk:
                attempt.status = "stream_error"
            if not attempt.first_sent and has_token(chunk):
                self.mark_first(from_prefill=False)
            if attempt.retried and "timings" in chunk:
                raw = sse_event(rewrite_final(attempt, chunk, attempt.retried_handoff()))
            elif isinstance(chunk.get("handoff"), dict):
                raw = sse_event(rewrite_final(attempt, chunk, await attempt.merge(chunk["handoff"])))
        if attempt.phase is not Phase.STREAMING and attempt.status == "200":
            self.held.append(raw)
            return ""
        return self.flush() + raw

    # -- failures -------------------------------------------------------------------------------------
    async def recover(self, failure: BaseException) -> BaseException | None:
        """Go on after a failed decode answer: migrate (the client has tokens) or retry (it has
        none). None if the stream goes on; else the failure to end it with."""
        attempt = self.attempt
        try:
            if attempt.first_sent:
                return await self.migrate(failure)
            if await retry_elsewhere(attempt, failure):
                async with asyncio.timeout_at(attempt.deadline):
                    await self.reopen(attempt)
                self.reset(first_done=False)
                self.held = []
                return None
        except FAILURES as again:            # the retry failed too
            return again
        except TimeoutError:
            return deadline_error(attempt.config.request_timeout)
        return failure

    async def migrate(self, failure: BaseException) -> BaseException | None:
        """Continue the stream on another decode worker from the prompt and the tokens sent."""
        attempt, sent = self.attempt, self.sent
        limit = attempt.config.migration_limit
        while len(attempt.migrations) < limit and sent.followed:
            reason = failure_message(failure)
            failed = attempt.decode
            if isinstance(failure, WorkerFailure) and failure.code in ("worker_failed", "worker_unreachable") \
                    and attempt.config.health_interval > 0:
                failed.healthy = False          # out of rotation until a poll says it is back
            await attempt.release_legs()
            attempt.upstream, attempt.open_legs = [], set()
            attempt.excluded.add(failed.url)
            target = attempt.pick(Role.DECODE)
            attempt.migrations.append({"from": failed.url, "to": target.url, "reason": reason,
                                       "tokens_sent": len(sent.token_ids)})
            attempt.router.metrics.migrations.labels(attempt.mode.value).inc()
            log.warning("handoff %s: %s after %d tokens; continuing on %s", attempt.handoff_id, reason,
                        len(sent.token_ids), target)
            try:
                async with asyncio.timeout_at(attempt.deadline):
                    resp = await attempt.resume_on(target, sent.token_ids, sent.chars)
            except (UpstreamError, *FAILURES) as exc:
                failure = worker_failure(target, exc) if isinstance(exc, UpstreamError) else exc
                continue
            self.reset(first_done=True)
            self.events = attempt.events(resp)
            return None
        return failure

    def reset(self, first_done: bool) -> None:
        if self.pending is not None:
            self.pending.cancel()
        self.events, self.pending, self.first_done = None, None, first_done


async def relay_events(attempt: Attempt, reopen: Callable[[Attempt], Awaitable[None]]) -> AsyncIterator[str]:
    """The client's stream. `reopen` runs a fresh attempt after a retry on other workers."""
    async for text in Follow(attempt, reopen).run():
        yield text


def error_message(data: str) -> str:
    chunk = data_json(data.strip().split("\n"))
    error = (chunk or {}).get("error")
    return (error.get("message") if isinstance(error, dict) else None) or "an error event"


def has_token(chunk: dict) -> bool:
    """Does this completion or chat chunk carry generated text (not the role-only opening chunk)?"""
    for choice in chunk.get("choices") or ():
        if isinstance(choice, dict) and (choice.get("text") or (choice.get("delta") or {}).get("content")):
            return True
    return False
