"""EngineLoop: one background thread that drives LLMEngine.step() for a server.

Callers on other threads submit and abort through an inbox; the loop applies those between steps
(so the engine itself is only ever touched by its own thread) and hands each step's outputs to the
per-request callbacks. It sleeps when there is nothing to do.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from kvhandoff.engine.engine import LLMEngine
from kvhandoff.engine.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


@dataclass
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    on_output: OutputCallback
    arrival: float
    prefill_only: bool = False
    retain: bool = False
    preloaded: tuple[str, int] | None = None
    num_remote_kv_tokens: int | None = None                 # set: K/V will arrive from another worker
    # engine thread: the blocks it will arrive in, and how many leading tokens' K/V are already local
    on_reserved: Callable[[list[int], int], None] | None = None


@dataclass
class _Call:
    fn: Callable[[], object]
    result: Future = field(default_factory=Future)


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: list[_Submit | _Call | str] = []   # submissions, calls, or request ids to abort
        self._reservations: list[_Submit] = []          # remote-KV requests waiting for free blocks
        self._wake = threading.Condition()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stopping = False
        self.fatal_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.num_steps = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               on_output: OutputCallback, prefill_only: bool = False, retain: bool = False,
               preloaded: tuple[str, int] | None = None) -> None:
        """Queue a request (options as LLMEngine.add_request). Raises ValueError (a message for the
        client) if it can never be served."""
        self.engine.validate(prompt_token_ids, params)     # reads only immutable engine facts
        self._post(_Submit(request_id, list(prompt_token_ids), params, on_output, time.monotonic(), prefill_only,
                           retain=retain, preloaded=preloaded))

    def submit_remote(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      num_kv_tokens: int, on_output: OutputCallback,
                      on_reserved: Callable[[list[int], int], None], retain: bool = False) -> None:
        """Queue a request whose first `num_kv_tokens` of K/V another worker delivers. As soon as the
        pool has room, blocks are reserved and `on_reserved(block_ids, num_local_tokens)` runs on the
        engine thread (the first num_local_tokens' K/V were found here already); the caller then fills
        the rest and calls engine.kv_ready (through call()) or kv_failed."""
        self.engine.validate(prompt_token_ids, params)
        self._post(_Submit(request_id, list(prompt_token_ids), params, on_output, time.monotonic(),
                           retain=retain, num_remote_kv_tokens=num_kv_tokens, on_reserved=on_reserved))

    def kv_failed(self, request_id: str, recompute: bool, reason: str, settled: bool = True) -> Future:
        """A remote-KV request's K/V will not come: recompute it here or end it with `reason`
        (engine.kv_failed), also when it is still queued for blocks: then nothing was reserved, and
        it simply becomes a local request (or an error) instead of waiting for KV nobody sends."""
        def on_engine() -> RequestOutput | None:
            queued = self._unqueue(request_id)
            if queued is None:
                return self.engine.kv_failed(request_id, recompute, reason, settled=settled)
            return self._start_local(queued) if recompute else _ended(queued, "error", reason)
        return self.call(on_engine)

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn()` on the engine thread between steps (the only thread that may touch the engine);
        the future holds what it returned (or raised)."""
        item = _Call(fn)
        self._post(item)
        return item.result

    def abort(self, request_id: str) -> None:
        self._post(request_id)

    def _post(self, item) -> None:
        with self._wake:
            if self._stopping or self.fatal_error:
                raise RuntimeError(self.fatal_error or "the engine is shutting down")
            self._inbox.append(item)
            self._wake.notify()

    def knows(self, request_id: str) -> bool:
        """Whether the request is still queued or running (a racy read: for housekeeping only)."""
        with self._wake:
            queued = [i for i in self._inbox if isinstance(i, _Submit)] + list(self._reservations)
        return request_id in self.engine.requests or any(r.request_id == request_id for r in queued)

    def stats(self) -> dict:
        engine = self.engine
        return {"num_free_blocks": engine.num_free_blocks, "num_blocks": engine.num_blocks,
                "block_size": engine.block_size, "num_running": len(engine.scheduler.running),
                "num_waiting": len(engine.scheduler.waiting) + len(self._reservations),
                "num_waiting_for_kv": len(engine.scheduler.waiting_for_kv),
                "num_pinned_handoffs": len(engine.pinned), "num_quarantined": len(engine.quarantine),
                "num_retained": len(engine.retained),
                "num_retained_blocks": sum(len(e.block_ids) for e in list(engine.retained.values())),
                "block_bytes": engine.block_bytes, "dtype": str(engine.dtype).removeprefix("torch."),
                "prefix_caching": engine.pool.enable_prefix_caching,
                "num_preemptions": engine.scheduler.num_preemptions,
                "prefix_cache_hits": engine.pool.hits, "prefix_cache_queries": engine.pool.queries}

    # ---- the thread ---------------------------------------------------------------------------
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:        # a bug in the engine: fail everyone loudly rather than hang them
            log.exception("engine loop died")
            with self._wake:
                self.fatal_error = f"engine failure: {exc}"
                inbox, self._inbox = self._inbox, []
            pending = list(self._callbacks.items()) + [(i.request_id, i.on_output) for i in inbox
                                                       if isinstance(i, _Submit)]
            self._callbacks.clear()
            for request_id, callback in pending:
                callback(RequestOutput(request_id, [], "", True, "error", 0, 0, error=self.fatal_error))

    def _serve(self) -> None:
        progressed = False      # the last step ran something: it may have freed blocks
        while True:
            with self._wake:
                while not self._inbox and not self._stopping and self._idle(progressed):
                    self._wake.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
            outputs = [out for item in inbox if (out := self._apply(item)) is not None]
            outputs += self._reserve()
            progressed = False
            if self.engine.has_work():
                outputs += self.engine.step()
                self.num_steps += 1
                progressed = not self.engine.stalled
            self._deliver(outputs)
        # Shutdown: end everything still in flight so callers are not left waiting.
        self._deliver([out for rid in list(self.engine.requests) if (out := self.engine.abort(rid))])

    def _idle(self, progressed: bool) -> bool:
        """Nothing to do until a message comes: the engine has no work, or none it can run (a stalled
        step would only spin), and the queue for blocks has nothing to retry. Reservations retry after
        a step that ran (the last step of a request frees its blocks, and then the engine may have no
        work left) or a message (a call() that releases blocks wakes us)."""
        if self.engine.has_work() and not self.engine.stalled:
            return False
        return not (progressed and self._reservations)

    def _apply(self, item: _Submit | _Call | str) -> RequestOutput | None:
        if isinstance(item, str):
            queued = self._unqueue(item)
            return self.engine.abort(item) if queued is None else _ended(queued, "abort")
        if isinstance(item, _Call):
            try:
                result = item.fn()
            except Exception as exc:    # a connector's bug must not stop every other request
                log.exception("engine call %r failed", item.fn)
                item.result.set_exception(exc)
                return None
            item.result.set_result(result)
            return result if isinstance(result, RequestOutput) else None
        self._callbacks[item.request_id] = item.on_output
        if item.num_remote_kv_tokens is not None:
            self._reservations.append(item)
            return None
        return self._start_local(item)

    def _start_local(self, item: _Submit) -> RequestOutput | None:
        """Hand a submission to the engine; the error output if the engine refuses it."""
        try:
            self.engine.add_request(item.request_id, item.prompt_token_ids, item.params, arrival=item.arrival,
                                    prefill_only=item.prefill_only, retain=item.retain, preloaded=item.preloaded)
        except ValueError as exc:
            return _ended(item, "error", str(exc))
        return None

    def _unqueue(self, request_id: str) -> _Submit | None:
        """Take a remote-KV request out of the queue for blocks, if it is still there (nothing reserved)."""
        queued = next((r for r in self._reservations if r.request_id == request_id), None)
        if queued is not None:
            self._reservations.remove(queued)
        return queued

    def _reserve(self) -> list[RequestOutput]:
        """Reserve blocks for queued remote-KV requests, oldest first, while the pool has room."""
        outputs = []
        while self._reservations:
            item = self._reservations[0]
            try:
                blocks = self.engine.reserve_for_remote_kv(item.request_id, item.prompt_token_ids, item.params,
                                                           item.num_remote_kv_tokens, arrival=item.arrival,
                                                           retain=item.retain)
            except ValueError as exc:
                self._reservations.pop(0)
                outputs.append(_ended(item, "error", str(exc)))
                continue
            if blocks is None:
                break               # FIFO: later requests wait behind the first, as in the scheduler
            self._reservations.pop(0)
            item.on_reserved(blocks, self.engine.requests[item.request_id].num_cached_tokens)
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            callback = self._callbacks.pop(out.request_id, None) if out.finished else self._callbacks.get(out.request_id)
            if callback is None:
                continue
            try:
                callback(out)
            except Exception:           # a broken consumer must not stop the engine
                log.exception("output callback for %s failed", out.request_id)


def _ended(item: _Submit, finish_reason: str, error: str | None = None) -> RequestOutput:
    """The final output of a submission that ended before the engine computed anything for it."""
    return RequestOutput(item.request_id, [], "", True, finish_reason, len(item.prompt_token_ids), 0, error=error)
