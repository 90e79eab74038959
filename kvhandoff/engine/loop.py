"""EngineLoop: one background thread that drives LLMEngine.step() for a server.

Callers on other threads submit and abort through an inbox; the loop applies those between steps
(so the engine itself is only ever touched by its own thread) and hands each step's outputs to the
per-request callbacks. It sleeps when there is nothing to do; a connector with finished transfers
wakes it (wake()), and the next step polls them.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvhandoff.engine.engine import LLMEngine
from kvhandoff.engine.holds import Hold
from kvhandoff.engine.request import FinishReason, RequestOutput, Resume, SamplingParams

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]
# While the engine has work, its pool's events are handed on at most this often; at once when it is
# about to sleep. Every hand-over wakes the publisher's thread, which then takes the engine's core and
# the GIL for about 0.3 ms (2-core AVX2 EPYC, tiny model, cProfile); a decode worker fills a block
# every 16 tokens, so unbatched that was 10 us of every 0.6 ms token. A router then learns what a busy
# worker holds up to this much later (a stale index costs a worse pick, never a wrong answer:
# router/kv_index.py).
KV_EVENTS_EVERY_S = 0.05


@dataclass
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    on_output: OutputCallback
    arrival: float
    prefill_only: bool = False
    retain: bool = False
    remote_tokens: int = 0
    resume: Resume | None = None


@dataclass
class _Call:
    fn: Callable[[], object]
    result: Future = field(default_factory=Future)


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: list[_Submit | _Call | str] = []   # submissions, calls, or request ids to abort
        self._wake = threading.Condition()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stopping = False
        self.fatal_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.num_steps = 0
        self.step_delay_s = 0.0         # tests only (--inject-faults step_ms): every step takes this much longer
        self.fail_steps = False         # tests only (--inject-faults engine_fail): a step raises, as a bug would
        self.step_ms: float | None = None   # how long steps take lately (EWMA), for load-aware routing
        self.asleep = False             # waiting for a message (nothing it can run): tests await it
        # Called (on the loop's thread) once the loop died of a bug: a worker stops itself, so that
        # its supervisor starts a fresh one instead of keeping a process that can only answer 503.
        self.on_fatal: Callable[[str], None] | None = None
        # Called (on the loop's thread) with the block pool's events (worker/kv_events.py), those of
        # up to KV_EVENTS_EVERY_S at a time: set once, before start(); the pool records events only then.
        self.on_kv_events: Callable[[list[tuple]], None] | None = None
        self._kv_events_since: float | None = None     # when the pool's oldest events not handed on came

    def start(self) -> None:
        if self.on_kv_events is not None:
            self.engine.pool.events = []
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               on_output: OutputCallback, prefill_only: bool = False, retain: bool = False,
               remote_tokens: int = 0, resume: Resume | None = None) -> None:
        """Queue a request (options as LLMEngine.add_request). Raises ValueError (a message for the
        client) if it can never be served."""
        self.engine.validate(prompt_token_ids, params, resume)     # reads only immutable engine facts
        self._post(_Submit(request_id, list(prompt_token_ids), params, on_output, time.monotonic(), prefill_only,
                           retain, remote_tokens, resume))

    def wake(self) -> None:
        """Any thread: something for the next step (the connector's finished transfers)."""
        with self._wake:
            self._wake.notify()

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
            queued = [i.request_id for i in self._inbox if isinstance(i, _Submit)]
        return request_id in self.engine.requests or request_id in queued

    def stats(self) -> dict:
        """What /health reports; racy reads of the engine thread's state (for monitoring and routing)."""
        engine, scheduler = self.engine, self.engine.scheduler
        retained = engine.holds.of(Hold.RETAINED)
        live = list(engine.requests.values())        # one C-level copy: safe while the engine thread runs
        return {"num_tokens_to_generate": sum(max(0, r.params.max_tokens - len(r.output_token_ids)) for r in live
                                              if not r.prefill_only),
                "num_tokens_to_prefill": sum(max(0, r.num_prompt_tokens - max(r.num_computed_tokens, r.remote_tokens))
                                             for r in live),
                "step_ms": None if self.step_ms is None else round(self.step_ms, 3),
                "num_free_blocks": engine.num_free_blocks, "num_blocks": engine.num_blocks,
                "block_size": engine.block_size, "num_running": len(scheduler.running),
                "num_waiting": len(scheduler.waiting) + len(scheduler.waiting_remote),
                "num_waiting_for_kv": len(scheduler.waiting_for_kv),
                "num_pinned_handoffs": engine.holds.count(Hold.PINNED),
                "num_quarantined": engine.holds.count(Hold.SET_ASIDE),
                "num_retained": len(retained), "num_retained_blocks": sum(len(h.block_ids) for h in retained),
                "block_bytes": engine.block_bytes, "dtype": str(engine.dtype).removeprefix("torch."),
                "prefix_caching": engine.pool.enable_prefix_caching,
                "num_preemptions": engine.scheduler.num_preemptions,
                "prefix_cache_hits": engine.pool.hits, "prefix_cache_queries": engine.pool.queries}

    # ---- the thread ---------------------------------------------------------------------------
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    def _run(self) -> None:
        torch.set_num_threads(self.engine.threads)      # (the loading thread keeps one: LLMEngine)
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
                callback(RequestOutput(request_id, [], "", True, FinishReason.ERROR, 0, 0, error=self.fatal_error))
            if self.on_fatal is not None:
                self.on_fatal(self.fatal_error)

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and not self._stopping and self._idle():
                    self.asleep = True
                    self._wake.wait()
                    self.asleep = False
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
            outputs = [out for item in inbox if (out := self._apply(item)) is not None]
            if self.engine.has_work():
                started, forward_s = time.perf_counter(), self.engine.forward_s
                if self.step_delay_s:       # before the step: what it makes (a token, a computed prompt) is late too
                    time.sleep(self.step_delay_s)
                if self.fail_steps:
                    raise RuntimeError("injected engine failure (--inject-faults engine_fail)")
                outputs += self.engine.step()
                self.num_steps += 1
                if self.engine.forward_s != forward_s:          # a step that ran the model
                    ms = (time.perf_counter() - started) * 1e3
                    self.step_ms = ms if self.step_ms is None else 0.8 * self.step_ms + 0.2 * ms
            self._deliver(outputs)
            if self.on_kv_events is not None and self.engine.pool.events:
                now = time.monotonic()
                self._kv_events_since = self._kv_events_since or now
                if now - self._kv_events_since >= KV_EVENTS_EVERY_S or self._idle():
                    self.flush_kv_events()
        # Shutdown: end everything still in flight so callers are not left waiting.
        self._deliver([out for rid in list(self.engine.requests) if (out := self.engine.abort(rid))])

    def flush_kv_events(self) -> None:
        """Loop thread: hand the pool's events on now (before the loop sleeps, and before any event
        that must follow them: a retention's, a snapshot)."""
        self._kv_events_since = None
        if self.on_kv_events is not None and self.engine.pool.events:
            self.on_kv_events(self.engine.pool.take_events())

    def _idle(self) -> bool:
        """Nothing to do until a message comes: the engine has no work, or none it can run (a
        stalled step would only spin) and the connector has no finished transfer to hand over.
        (Blocks a step frees are found by the next one: a step that freed any was not stalled.)"""
        if self.engine.connector.has_events():
            return False
        return not self.engine.has_work() or self.engine.stalled

    def _apply(self, item: _Submit | _Call | str) -> RequestOutput | None:
        if isinstance(item, str):
            return self.engine.abort(item)
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
        try:
            self.engine.add_request(item.request_id, item.prompt_token_ids, item.params, arrival=item.arrival,
                                    prefill_only=item.prefill_only, retain=item.retain,
                                    remote_tokens=item.remote_tokens, resume=item.resume)
        except ValueError as exc:
            return _ended(item, FinishReason.ERROR, str(exc))
        return None

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            callback = self._callbacks.pop(out.request_id, None) if out.finished else self._callbacks.get(out.request_id)
            if callback is None:
                continue
            try:
                callback(out)
            except Exception:           # a broken consumer must not stop the engine
                log.exception("output callback for %s failed", out.request_id)


def _ended(item: _Submit, finish_reason: FinishReason, error: str | None = None) -> RequestOutput:
    """The final output of a submission that ended before the engine computed anything for it."""
    return RequestOutput(item.request_id, [], "", True, finish_reason, len(item.prompt_token_ids), 0, error=error)
