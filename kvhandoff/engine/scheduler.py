"""Continuous batching: which requests run this step, and how many of their tokens.

Each step has a token budget. Running requests that are decoding go first (one token each, so
inter-token latency does not suffer from long prompts), then running requests still prefilling,
then waiting requests in arrival order, each taking a chunk of at most the remaining budget
(chunked prefill). A waiting request is admitted only when the blocks for its chunk are free
(admission control); when a running request cannot grow, the newest running request is preempted
and later recomputed (its blocks go back to the pool, its generated tokens are kept).

A third section admits remote-KV requests (the K/V of their first `remote_tokens` comes from another
worker): in arrival order, each gets the blocks that K/V lands in as soon as the pool has room,
minus the leading blocks this engine's prefix cache already holds, and the connector is told
(KVConnector.reserved). They then wait, outside the token budget, until the K/V lands
(kv_arrived) or will not come (remote_lost).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from kvhandoff.config import EngineConfig
from kvhandoff.engine.block_pool import BlockPool, block_hash, hash_chain
from kvhandoff.engine.kv_connector import KVConnector
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
    def __init__(self, cfg: EngineConfig, pool: BlockPool, make_room: Callable[[int], bool] | None = None,
                 connector: KVConnector | None = None):
        """`make_room(n)`: are n blocks free, once blocks held for later (retained history) have been
        freed for them if need be?"""
        self.cfg, self.pool = cfg, pool
        self.make_room = make_room or (lambda num_blocks: num_blocks <= pool.num_free)
        self.connector = connector or KVConnector()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_remote: deque[Request] = deque()       # remote-KV requests queued for blocks
        self.waiting_for_kv: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_reserved = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.block_size)

    def add(self, request: Request) -> None:
        if request.remote_tokens:
            assert 0 < request.remote_tokens <= request.num_prompt_tokens
            request.state = RequestState.WAITING_REMOTE
            self.waiting_remote.append(request)
        else:
            request.state = RequestState.WAITING
            self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_remote)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.cfg.max_num_batched_tokens
        scheduled: dict[str, ScheduledChunk] = {}
        preempted = False
        decoding = [r for r in self.running if r.num_target_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_target_tokens - r.num_computed_tokens > 1]
        for request in decoding + prefilling:
            if budget == 0:
                break
            if request.state is not RequestState.RUNNING:
                continue                # preempted earlier in this loop to make room
            num_new = min(request.num_target_tokens - request.num_computed_tokens, budget)
            num_preemptions = self.num_preemptions
            grown = self._grow(request, num_new)
            if self.num_preemptions != num_preemptions:
                preempted = True
                # The newest requests go first, and decodes are scheduled before prompt chunks: a
                # victim may already have its chunk in this step (it has no blocks now).
                for victim in [rid for rid, chunk in scheduled.items() if chunk.request.state is not RequestState.RUNNING]:
                    budget += scheduled.pop(victim).num_new_tokens
            if grown:
                scheduled[request.request_id] = ScheduledChunk(request, num_new)
                budget -= num_new
        chunks = list(scheduled.values())
        # Admit waiting requests only when nobody had to be preempted this step: otherwise the
        # preempted request would be re-admitted at once and thrash.
        while self.waiting and budget > 0 and not preempted and self._num_seqs() < self.cfg.max_num_seqs:
            request = self.waiting[0]
            assert not request.block_table, "a waiting request holds blocks"
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
        self._reserve_remote()
        return chunks

    def _reserve_remote(self) -> None:
        """Blocks for queued remote-KV requests, oldest first, while the pool has room (FIFO: later
        ones wait behind the first, as waiting requests do)."""
        bs = self.pool.block_size
        while self.waiting_remote and self._num_seqs() < self.cfg.max_num_seqs:
            request = self.waiting_remote[0]
            num_remote = request.remote_tokens
            # Full blocks this engine holds already (its prefix cache: a conversation's retained
            # history, say) need not travel; the last remote block always does.
            local = self.pool.match_prefix(hash_chain(request.prompt_token_ids[:num_remote - 1], bs))
            need = self.blocks_for(num_remote) - len(local)
            if not self.make_room(need):
                self.pool.free_blocks(local)
                return
            self.waiting_remote.popleft()
            request.block_table = local + self.pool.allocate(need)
            request.num_cached_tokens = len(local) * bs
            request.state = RequestState.WAITING_FOR_KV
            self.waiting_for_kv[request.request_id] = request
            self.num_reserved += 1
            self.connector.reserved(request, len(local) * bs)

    def _num_seqs(self) -> int:
        """Sequences that run or will run as soon as their K/V lands (kv_arrived starts them)."""
        return len(self.running) + len(self.waiting_for_kv)

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
                self.pool.register(request.block_table[index], hashes[index], hashes[index - 1] if index else None,
                                   tokens[index * bs:(index + 1) * bs])

    def finish(self, request: Request, reason: FinishReason, keep_blocks: bool = False) -> None:
        """Take the request out of its queue; free its blocks unless the caller now owns them."""
        self._unqueue(request)
        if not keep_blocks:
            self._release(request)
        request.state = RequestState.FINISHED
        request.finish_reason = reason

    def _unqueue(self, request: Request) -> None:
        if request.state is RequestState.RUNNING:
            self.running.remove(request)
        elif request.state is RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state is RequestState.WAITING_REMOTE:
            self.waiting_remote.remove(request)
        elif request.state is RequestState.WAITING_FOR_KV:
            del self.waiting_for_kv[request.request_id]

    def kv_arrived(self, request: Request) -> None:
        """A WAITING_FOR_KV request's blocks now hold the K/V of its remote tokens: count them as
        computed, publish their full blocks, and run it (to decode, or to compute the rest of its
        prompt). A prefix fetched for a prompt counts as cached, as a local prefix-cache hit would.

        It joins the running requests, not the waiting queue: waiting requests hold no blocks. One
        queued behind a head that does not fit would keep its blocks from everyone, and with nothing
        running nothing would ever free any (the fault matrix's push/decode-killed case hung that way
        on a slow machine: 5 requests waiting, none running, 34 of 256 blocks free, for a minute).
        Running, it is served first and, when the pool runs out, preempted like the others."""
        assert request.state is RequestState.WAITING_FOR_KV
        num_tokens = request.remote_tokens
        assert len(request.block_table) >= self.blocks_for(num_tokens)
        del self.waiting_for_kv[request.request_id]
        request.timings.kv_ready = time.monotonic()
        request.num_computed_tokens = 0
        self.after_step([ScheduledChunk(request, num_tokens)])
        if num_tokens < request.num_prompt_tokens:
            request.num_cached_tokens = num_tokens
        request.state = RequestState.RUNNING
        self.running.append(request)

    def remote_lost(self, request: Request) -> list[int]:
        """The remote K/V will not come and the request will be computed here: it becomes an
        ordinary waiting request. Returns the blocks it had reserved (the caller frees or sets them
        aside: a transfer may still be writing into them)."""
        assert request.state in (RequestState.WAITING_REMOTE, RequestState.WAITING_FOR_KV)
        self._unqueue(request)
        blocks, request.block_table = request.block_table, []
        request.num_computed_tokens = request.num_cached_tokens = request.remote_tokens = 0
        request.state = RequestState.WAITING
        self.waiting.append(request)
        return blocks

