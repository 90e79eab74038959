"""How a worker can fail a request, as the router sees it, and the messages that name the worker."""
from __future__ import annotations

import asyncio
import json

from kvhandoff.router.answer import Answer, Unreachable, UpstreamError
from kvhandoff.wire import api as P
from kvhandoff.wire.http import describe


class WorkerFailure(P.APIError):
    """A worker could not be reached, broke off its answer, or answered garbage (502)."""

    def __init__(self, worker, message: str, code: str):
        super().__init__(502, message, type="server_error", code=code)
        self.worker = worker


class Relay(Exception):
    """A worker's own error answer (4xx/5xx), relayed to the client with its status and body."""

    def __init__(self, worker, status: int, body: dict, retry_after: str | None = None):
        super().__init__(f"{worker} answered {status}")
        self.worker, self.status, self.body, self.retry_after = worker, status, body, retry_after


def status_of(failure: BaseException) -> int:
    return failure.status if isinstance(failure, (Relay, P.APIError)) else 500


def worker_failure(worker, e: UpstreamError) -> WorkerFailure:
    if isinstance(e, Unreachable):
        return WorkerFailure(worker, f"cannot reach the {worker}: {describe(e)}", "worker_unreachable")
    return WorkerFailure(worker, f"the {worker} failed mid-request: {describe(e)}", "worker_failed")


def failure_message(failure: BaseException) -> str:
    if isinstance(failure, Relay):
        error = failure.body.get("error") if isinstance(failure.body, dict) else None
        detail = error.get("message") if isinstance(error, dict) else None
        return f"{failure}: {detail}" if detail else str(failure)
    return getattr(failure, "message", None) or str(failure)


def refused(failure: BaseException | None) -> bool:
    """A prefill failure that dooms the request (4xx, unreachable) rather than a 5xx."""
    return (isinstance(failure, Relay) and failure.status < 500) or \
        (isinstance(failure, P.APIError) and failure.code == "worker_unreachable")


def stream_error(failure: BaseException, message: str) -> dict:
    """The error event that ends a stream already under way. A worker's backpressure (429) can only
    come this way once the client has a token (pull: the prefill's first token is sent before the
    decode worker admits the request), so it keeps its meaning: OpenAI's code for it, and when to retry."""
    if isinstance(failure, Relay) and failure.status == 429:
        after = f"; retry after {failure.retry_after} s" if failure.retry_after else ""
        return P.error_body(message + after, "server_error", code="rate_limit_exceeded")
    return P.error_body(message, "server_error")


def deadline_error(seconds: float) -> P.APIError:
    return P.APIError(504, f"the request took longer than the router's --request-timeout of {seconds:g} s",
                      type="server_error", code="request_timeout")


async def error_json(worker, resp: Answer) -> dict:
    """A worker's error body as OpenAI error JSON: as sent if it is one, wrapped otherwise."""
    try:
        raw = await resp.read()
    except UpstreamError as e:
        raw = f"(body lost: {describe(e)})".encode()
    try:
        data = json.loads(raw)
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return data
    except ValueError:
        pass
    text = raw.decode(errors="replace").strip()[:300]
    return P.error_body(f"the {worker} answered {resp.status}: {text}",
                        "invalid_request_error" if resp.status < 500 else "server_error")


def task_outcome(task: asyncio.Task) -> tuple[dict | None, str | None]:
    """(result, None) or (None, what went wrong) for a finished-or-not prefill task."""
    if not task.done():
        return None, "the prefill worker had not answered yet"
    if task.cancelled():
        return None, "cancelled"
    e = task.exception()
    if e is None:
        return task.result(), None
    if isinstance(e, Relay):
        return None, str((e.body.get("error") or {}).get("message") or e)
    return None, getattr(e, "message", None) or describe(e)
