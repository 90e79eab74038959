"""EngineLoop: one background thread that drives LLMEngine.step() for a server.

Callers on other threads submit and abort through an inbox; the loop applies those between steps
(so the engine itself is only ever touched by its own thread) and hands each step's outputs to the
per-request callbacks. It sleeps when there is nothing to do.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
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


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: list[_Submit | str] = []       # submissions, or request ids to abort
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
               on_output: OutputCallback) -> None:
        """Queue a request. Raises ValueError (a message for the client) if it can never be served."""
        self.engine.validate(prompt_token_ids, params)     # reads only immutable engine facts
        with self._wake:
            if self._stopping or self.fatal_error:
                raise RuntimeError(self.fatal_error or "the engine is shutting down")
            self._inbox.append(_Submit(request_id, list(prompt_token_ids), params, on_output, time.monotonic()))
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._inbox.append(request_id)
            self._wake.notify()

    def stats(self) -> dict:
        engine = self.engine
        return {"num_free_blocks": engine.num_free_blocks, "num_blocks": engine.num_blocks,
                "block_size": engine.block_size, "num_running": len(engine.scheduler.running),
                "num_waiting": len(engine.scheduler.waiting), "num_preemptions": engine.scheduler.num_preemptions,
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
        while True:
            with self._wake:
                while not self._inbox and not self._stopping and not self.engine.has_work():
                    self._wake.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
            outputs = [out for item in inbox if (out := self._apply(item)) is not None]
            if self.engine.has_work():
                outputs += self.engine.step()
                self.num_steps += 1
            self._deliver(outputs)
        # Shutdown: end everything still in flight so callers are not left waiting.
        self._deliver([out for rid in list(self.engine.requests) if (out := self.engine.abort(rid))])

    def _apply(self, item: _Submit | str) -> RequestOutput | None:
        if isinstance(item, str):
            return self.engine.abort(item)
        try:
            self.engine.add_request(item.request_id, item.prompt_token_ids, item.params, arrival=item.arrival)
        except ValueError as exc:
            item.on_output(RequestOutput(item.request_id, [], "", True, "error", len(item.prompt_token_ids),
                                         0, error=str(exc)))
            return None
        self._callbacks[item.request_id] = item.on_output
        return None

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            callback = self._callbacks.pop(out.request_id) if out.finished else self._callbacks.get(out.request_id)
            if callback is None:
                continue
            try:
                callback(out)
            except Exception:           # a broken consumer must not stop the engine
                log.exception("output callback for %s failed", out.request_id)
