"""How the handoff reaches the engine, from any thread (engine/kv_connector.py is the other way):
requests submitted with the protocol side whose hooks they go to, aborts, calls run on the engine
thread, and the events the engine polls at the start of its next step (K/V landed or lost, held
blocks to free; posting one wakes the engine loop). Also what the handoff reads of the engine's KV
pool: its layout, block checksums, how far a prompt has been computed."""
from __future__ import annotations

import asyncio
import threading
from typing import Callable

from kvhandoff.engine.kv_connector import KVEvents, Landed, Lost
from kvhandoff.engine.loop import EngineLoop
from kvhandoff.engine.request import RequestOutput, SamplingParams
from kvhandoff.worker.kv_layout import KVLayout, block_checksums

NO_EVENTS = KVEvents()      # what poll() returns most steps (never changed: the engine only reads it)


class EngineDoor:
    def __init__(self, loop: EngineLoop):
        self.loop, self.engine = loop, loop.engine
        self.kv = self.engine.runner.kv_cache
        self.layout = KVLayout.of(self.kv)
        self.block_size = self.engine.block_size
        # Engine request id -> (the side its hooks go to, that side's entry for it), until it ends.
        self.requests: dict[str, tuple[object, object]] = {}
        self._events = KVEvents()
        self._events_lock = threading.Lock()

    # ---- events for the engine --------------------------------------------------------------------
    def landed(self, request_id: str, first_token: int | None = None) -> None:
        self._post(lambda e: e.landed.append(Landed(request_id, first_token)))

    def lost(self, request_id: str, recompute: bool, reason: str, settled: bool = True) -> None:
        self._post(lambda e: e.lost.append(Lost(request_id, recompute, reason, settled)))

    def release(self, owner: str) -> None:
        """Free the blocks `owner` holds on this worker (a pin, a set-aside reservation)."""
        self._post(lambda e: e.release.append(owner))

    def _post(self, add: Callable[[KVEvents], None]) -> None:
        with self._events_lock:
            add(self._events)
        self.loop.wake()

    def poll(self) -> KVEvents:
        if not self._events:        # (every step; one being added now wakes the loop for the next)
            return NO_EVENTS
        with self._events_lock:
            events, self._events = self._events, KVEvents()
        return events

    def has_events(self) -> bool:
        return bool(self._events)

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, side, entry, request_id: str, prompt_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None], **options) -> None:
        """Queue a request whose engine hooks go to `side` (EngineLoop.submit options). ValueError,
        for the client, if the engine can never serve it."""
        self.requests[request_id] = (side, entry)
        try:
            self.loop.submit(request_id, prompt_ids, params, on_output, **options)
        except BaseException:
            self.requests.pop(request_id, None)
            raise

    async def compute(self, side, entry, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      remote_tokens: int = 0, on_submitted: Callable[[], None] = lambda: None) -> RequestOutput:
        """A prefill-only request, awaited (asyncio): its final output. `on_submitted` runs once the
        engine has taken it (nothing about the request can be refused any more). Cancelling the await
        (the router went away) does not abort it: the caller's cancel does."""
        aio = asyncio.get_running_loop()
        done = aio.create_future()

        def on_output(out: RequestOutput) -> None:      # engine thread
            if out.finished:
                aio.call_soon_threadsafe(lambda: done.done() or done.set_result(out))
        self.submit(side, entry, request_id, prompt_ids, params, on_output, prefill_only=True,
                    remote_tokens=remote_tokens)
        on_submitted()
        return await done

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def call(self, fn: Callable[[], object]):
        """Run `fn()` on the engine thread between steps; a Future of what it returns."""
        return self.loop.call(fn)

    # ---- the pool ---------------------------------------------------------------------------------
    def checksums(self, block_ids: list[int]) -> list[int]:
        return block_checksums(self.kv, block_ids)

    def is_token(self, token) -> bool:
        return isinstance(token, int) and not isinstance(token, bool) and \
            0 <= token < self.engine.model_config.vocab_size

    def computed_tokens(self, request_id: str) -> int:
        """Prompt tokens the engine has computed so far (a racy read of one int, enough to tell
        progress from none)."""
        request = self.engine.requests.get(request_id)
        return 0 if request is None else request.num_computed_tokens

    def cached_blocks(self) -> list[str]:
        """The prefix cache's block hashes (hex). Engine thread only."""
        return sorted(h.hex() for h in self.engine.pool.cached)

    def cached_prefix_len(self, hashes: list[bytes]) -> int:
        """How many of these leading blocks the prefix cache holds now. A peek from another thread:
        dict lookups are atomic under the GIL, and a block evicted a moment later only makes it an
        estimate (the engine computes what it no longer holds)."""
        return self.engine.pool.cached_prefix_len(hashes)
