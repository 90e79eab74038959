"""The router's leg of each protocol (docs/HANDOFF.md): which workers, in what order.

Every prefill answers in JSON lines: the first token the moment it is sampled (messages.FirstToken,
which the relay sends the client at once), then the handoff object. A leg sets `attempt.decode_task`
(the decode worker's answer, opening) and returns once the client can be answered: pull when the
first token is here (the decode worker is picked and admits the request after it), push when the
decode worker, picked at arrival, has admitted the request (a refusal is then still a clean 429).
"""
from __future__ import annotations

import asyncio
import logging

from kvhandoff.router.attempt import Attempt
from kvhandoff.wire.modes import Role

log = logging.getLogger("kvhandoff.router")


async def pull(attempt: Attempt) -> None:
    """Prefill first; the decode worker is picked with the load as it is once the prefill answered
    (late binding) and sent its handoff object. A prefill worker failure (5xx, unreachable, died)
    before the first token may be retried colocated on a decode worker (--retry-colocated)."""
    attempt.prefill = attempt.pick(Role.PREFILL)
    prefill = asyncio.ensure_future(attempt.run_prefill())
    attempt.decode_task = asyncio.ensure_future(_pull_decode(attempt, prefill))
    await attempt.answerable(opened=attempt.prefill_opened)


async def _pull_decode(attempt: Attempt, prefill: asyncio.Task):
    try:
        await prefill           # (run_prefill sets attempt.remote: the pin is released if we stop here)
    except Exception as failure:
        if not attempt.may_retry_colocated(failure) or attempt.first_sent:
            raise               # (after the first token: the relay continues the request elsewhere)
        return await attempt.retry_colocated(failure)
    if attempt.stream and attempt.first_token.result() is not None:
        # The client's first token goes out before anything that can wait for it: building and sending
        # the decode leg took the event loop ~0.5 ms between the prefill's answer and the client.
        await attempt.first_relayed.wait()
    attempt.decode = attempt.pick(Role.DECODE, prefer=attempt.history_worker)
    return await attempt.open_decode(remote=attempt.remote)


async def push(attempt: Attempt) -> None:
    """The decode worker picked at arrival (early binding), both legs sent at once. Before the decode
    answer starts, a prefill that refused the request (4xx, unreachable) ends it; one that failed
    (5xx) may be retried colocated (--retry-colocated). A prefill that fails later is reported to
    the decode worker (/kv/failed), which recomputes or fails by its policy."""
    attempt.decode = attempt.pick(Role.DECODE, prefer=attempt.history_worker)
    attempt.prefill = attempt.pick(Role.PREFILL)
    attempt.prefill_task = asyncio.ensure_future(attempt.run_prefill(decode_url=attempt.decode.url))
    attempt.prefill_task.add_done_callback(lambda task: _prefill_ended(attempt, task))
    decode = asyncio.ensure_future(attempt.open_decode(prefill_url=attempt.prefill.url))
    try:
        if attempt.config.late_binding and attempt.history_worker is None:
            decode = await late_bind(attempt, decode)
        await asyncio.wait({attempt.prefill_task, decode}, return_when=asyncio.FIRST_COMPLETED)
        failure = None if decode.done() else task_error(attempt.prefill_task)
        if failure is not None and attempt.may_retry_colocated(failure):
            decode.cancel()                 # closes the leg: the decode worker drops its reservation
            await asyncio.wait({decode})
            attempt.abandon(Role.DECODE)
            attempt.decode_task = asyncio.ensure_future(attempt.retry_colocated(failure))
            await attempt.answerable()
            return
        if failure is not None and attempt.refused(failure):
            raise failure
        await decode
        attempt.decode_task = decode
    finally:
        if not decode.done():
            decode.cancel()
            await asyncio.wait({decode})


async def late_bind(attempt: Attempt, decode: asyncio.Task) -> asyncio.Task:
    """Late binding (router --late-binding): until the prompt is computed, look at the decode worker
    again after every health poll, and move the request once if it has fallen behind
    (policies.late_binding_target): the prefill withdraws the registration (/kv/rebind, refused once
    its WRITE started), then the decode leg goes to the new worker. Returns the decode leg to go on
    with. (A turn whose history a decode worker retains stays with it: not called.)"""
    router = attempt.router
    while True:
        polled = asyncio.ensure_future(router.pool.next_poll())
        try:
            await asyncio.wait({attempt.prefill_task, attempt.first_token, polled} | ({decode} if not decode.done() else set()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            polled.cancel()
        if attempt.prefill_task.done() or attempt.first_token.done() or task_error(decode) is not None:
            return decode
        if not polled.done() or polled.cancelled():
            continue        # (the decode leg's answer began) only a poll brings news worth judging by
        move = attempt.fallen_behind()
        if move is None:
            continue
        target, here, there = move
        refused = await attempt.rebind()
        router.metrics.rebinds.labels(attempt.mode.value, "refused" if refused else "moved").inc()
        if refused:
            log.info("handoff %s: %s fell behind, but stays: %s", attempt.handoff_id, attempt.decode, refused)
            return decode
        log.info("handoff %s: %s fell behind (expected wait %.0f ms against %.0f); moved to %s",
                 attempt.handoff_id, attempt.decode, here, there, target)
        return await attempt.move_decode(target, decode)


def _prefill_ended(attempt: Attempt, task: asyncio.Task) -> None:
    """A prefill leg that failed once both legs were out (a 5xx, or its connection broke) is
    reported to decode at once (/kv/failed) instead of leaving it to --kv-timeout-s. A refusal, a
    failure the router retries colocated, and a cancel of the router's own are not."""
    failure = task_error(task)
    if attempt.ended or task is not attempt.prefill_task or failure is None or attempt.refused(failure):
        return
    if attempt.may_retry_colocated(failure) and not attempt.decode_opened:
        return
    attempt.report_prefill_failure(failure)


def task_error(task: asyncio.Task) -> BaseException | None:
    """The exception a finished task ended with; None if it is running, cancelled or succeeded."""
    return None if not task.done() or task.cancelled() else task.exception()
