"""Continuous batching: which requests run this step, and how many of their tokens.

Each step has a token budget. Running requests that are decoding go first (one token each, so
inter-token latency does not suffer from long prompts), then running requests still prefilling,
then waiting requests in arrival order, each taking a chunk of at most the remaining budget
(chunked prefill). A waiting request is admitted only when the blocks for its chunk are free
(admission control); when a running request cannot grow, the newest running request is preempted
and later recomputed (its blocks go back to the pool, its generated tokens are kept).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from kvhandoff.config import EngineConfig
from kvhandoff.engine.block_pool import BlockPool, block_hash, hash_chain
from kvhandoff.engine.request import FinishReason, Request, RequestState


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int                 # computed this step, from request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """This chunk reaches the request's target: the step samples a token for it."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_target_tokens


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: BlockPool, make_room: Callable[[int], bool] | None = None):
        """`make_room(n)`: are n blocks free, once blocks held for later (retained history) have been
        freed for them if need be?"""
        self.cfg, self.pool = cfg, pool
        self.make_room = make_room or (lambda num_blocks: num_blocks <= pool.num_free)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        self.num_preemptions = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.block_size)

    def add(self, request: Request) -> None:
        if request.state is RequestState.WAITING_FOR_KV:
            self.waiting_for_kv[request.request_id] = request
        else:
            request.state = RequestState.WAITING
            self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.cfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        decoding = [r for r in self.running if r.num_target_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_target_tokens - r.num_computed_tokens > 1]
        for request in decoding + prefilling:
            if budget == 0:
                break
            if request.state is not RequestState.RUNNING:
                continue                # preempted earlier in this loop to make room
            num_new = min(request.num_target_tokens - request.num_computed_tokens, budget)
            if not self._grow(request, num_new):
                preempted = True
                continue
            chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
        # Admit waiting requests only when nobody had to be preempted this step: otherwise the
        # preempted request would be re-admitted at once and thrash.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.cfg.max_num_seqs:
            request = self.waiting[0]
            if not request.block_table:
                self._match_prefix(request)
            num_new = min(request.num_target_tokens - request.num_computed_tokens, budget)
            need = self.blocks_for(request.num_computed_tokens + num_new) - len(request.block_table)
            if not self.make_room(need):
                self._release(request)      # admission control: wait until blocks free up
                break
            request.block_table += self.pool.allocate(need)
            self.waiting.popleft()
            request.state = RequestState.RUNNING
            self.running.append(request)
            chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
        return chunks

    def _grow(self, request: Request, num_new: int) -> bool:
        """Give `request` the blocks for `num_new` more tokens, preempting newer requests if needed."""
        need = self.blocks_for(request.num_computed_tokens + num_new) - len(request.block_table)
        self.make_room(need)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is request:
                return False
        if need > 0:
            request.block_table += self.pool.allocate(need)
        return True

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.state = RequestState.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _match_prefix(self, request: Request) -> None:
        # Never match the last target token: at least one token must be computed (to produce logits,
        # or to finish a prefill-only request), and new tokens must land in blocks this request owns alone.
        hashes = hash_chain(request.all_token_ids[:request.num_target_tokens - 1], self.pool.block_size)
        request.block_table = self.pool.match_prefix(hashes)
        request.num_computed_tokens = request.num_cached_tokens = len(request.block_table) * self.pool.block_size

    def _release(self, request: Request) -> None:
        self.pool.free_blocks(request.block_table)
        request.block_table = []
        request.num_computed_tokens = request.num_cached_tokens = 0

    def after_step(self, chunks: list[ScheduledChunk]) -> None:
        """Advance computed counts and publish newly completed full blocks to the prefix cache."""
        bs = self.pool.block_size
        for chunk in chunks:
            request = chunk.request
            first_full = request.num_computed_tokens // bs
            request.num_computed_tokens += chunk.num_new_tokens
            if not self.pool.enable_prefix_caching:
                continue
            last_full = request.num_computed_tokens // bs
            if last_full == first_full:
                continue
            hashes, tokens = request.block_hashes, request.all_token_ids
            while len(hashes) < last_full:
                start = len(hashes) * bs
                hashes.append(block_hash(hashes[-1] if hashes else None, tokens[start:start + bs]))
            for index in range(first_full, last_full):
                self.pool.register(request.block_table[index], hashes[index])

    def finish(self, request: Request, reason: FinishReason, keep_blocks: bool = False) -> None:
        """Take the request out of its queue; free its blocks unless the caller now owns them."""
        if request.state is RequestState.RUNNING:
            self.running.remove(request)
        elif request.state is RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state is RequestState.WAITING_FOR_KV:
            del self.waiting_for_kv[request.request_id]
        if not keep_blocks:
            self._release(request)
        request.state = RequestState.FINISHED
        request.finish_reason = reason

    def preloaded(self, request: Request, num_tokens: int) -> None:
        """A new request's blocks already hold its first `num_tokens` of K/V (fetched): count them as
        computed (and cached, for the report) and publish their full blocks."""
        request.num_computed_tokens = 0
        self.after_step([ScheduledChunk(request, num_tokens)])
        request.num_cached_tokens = num_tokens

    def kv_arrived(self, request: Request, num_tokens: int) -> None:
        """A WAITING_FOR_KV request's blocks now hold `num_tokens` of K/V: queue it for decoding."""
        assert request.state is RequestState.WAITING_FOR_KV
        assert len(request.block_table) >= self.blocks_for(num_tokens)
        del self.waiting_for_kv[request.request_id]
        request.timings.kv_ready = time.monotonic()
        request.num_computed_tokens = 0
        self.after_step([ScheduledChunk(request, num_tokens)])     # publishes its full blocks
        request.state = RequestState.WAITING
        self.waiting.append(request)

