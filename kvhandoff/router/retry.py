"""Retry on other workers: a worker that fails a request (5xx, unreachable, died) before the client
saw any of its answer is taken out of rotation (if it stopped answering), and the request runs once
more as a fresh handoff avoiding both workers of the failed attempt where it can. (Retrying a failed
prefill colocated on the decode worker, --retry-colocated, is Attempt.retry_colocated.)"""
from __future__ import annotations

import logging

from kvhandoff.router.attempt import Attempt
from kvhandoff.router.errors import Relay, WorkerFailure, failure_message, status_of

log = logging.getLogger("kvhandoff.router")


async def retry_elsewhere(attempt: Attempt, failure: BaseException) -> bool:
    """Give up this attempt (its legs released as if the client had left) and say whether to try once
    more. Only the worker's fault qualifies, only before any of the answer reached the client, and
    only when a healthy alternative exists: the same worker would most likely fail the same way."""
    router = attempt.router
    worker = failure.worker if isinstance(failure, (Relay, WorkerFailure)) else None
    if isinstance(failure, WorkerFailure) and failure.code != "bad_worker_answer" and router.config.health_interval > 0:
        worker.healthy = False          # it stopped answering: out of rotation until a poll says ok
    if worker is None or status_of(failure) < 500 or not attempt.retryable or not router.pool.has_alternative(worker):
        return False
    reason = failure_message(failure)
    log.warning("handoff %s: %s; retrying once on other workers", attempt.handoff_id, reason)
    router.metrics.retries.labels(attempt.mode.value, worker.role).inc()
    await attempt.release_legs()
    # Both of the attempt's workers, not just the one that answered the error: a decode worker's 502
    # may be about its prefill peer ("prefill worker ... unreachable"). Exclusion only orders the
    # choice, so a role with no other worker still gets one.
    attempt.excluded |= {w.url for w in (attempt.prefill, attempt.decode, worker) if w is not None}
    attempt.retry_reason = reason
    attempt.next_attempt()
    return True
