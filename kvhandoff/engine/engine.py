"""LLMEngine: requests in, tokens and text out, one scheduling step at a time (no threads here).

It wires the loaded model, the block pool, the scheduler, the runner and the sampler together,
applies stop conditions and turns tokens into text incrementally. The thread that drives `step()`
for a server lives in kvhandoff.engine.loop.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable

import torch

from kvhandoff.config import EngineConfig
from kvhandoff.engine.block_pool import BlockPool, hash_chain
from kvhandoff.engine.request import FinishReason, Request, RequestOutput, RequestState, RetainedKV, SamplingParams
from kvhandoff.engine.runner import ModelRunner, kv_block_bytes
from kvhandoff.engine.sampler import Sampler
from kvhandoff.engine.scheduler import Scheduler
from kvhandoff.model.loader import load_model

log = logging.getLogger(__name__)


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: PyTorch's bf16 matmuls then beat fp32 several times over on this CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_device_dtype(cfg: EngineConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if cfg.device == "auto" else cfg.device))
    if cfg.dtype != "auto":
        return device, getattr(torch, cfg.dtype)
    # Measured by kvhandoff.bench.engine: on CPUs with bf16 instructions bf16 is the faster choice;
    # elsewhere fp32 (bf16 would be emulated and slow).
    fast_bf16 = device.type == "cuda" or cpu_has_fast_bf16()
    return device, torch.bfloat16 if fast_bf16 else torch.float32


class LLMEngine:
    def __init__(self, cfg: EngineConfig, kv_allocator=None):
        """`kv_allocator(nbytes) -> uint8 tensor`, if given, provides the KV pool's memory (a worker
        passes its transfer agent's shared-memory allocator so peers can copy blocks directly)."""
        self.cfg = cfg
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        self.device, self.dtype = pick_device_dtype(cfg)
        model_len = cfg.max_model_len or None
        self.loaded = load_model(cfg.model, dtype=self.dtype, device=self.device, max_positions=model_len)
        self.tokenizer = self.loaded.tokenizer
        self.served_name = self.loaded.served_name
        self.model_config = self.loaded.config
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        self.block_size = cfg.block_size
        self.block_bytes = kv_block_bytes(self.model_config, cfg.block_size, self.dtype)
        num_blocks = cfg.num_blocks or max(1, cfg.kv_cache_bytes // self.block_bytes)
        self.pool = BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.pool, make_room=self.make_room)
        kv_memory = None if kv_allocator is None else kv_allocator(num_blocks * self.block_bytes)
        self.runner = ModelRunner(self.loaded.model, num_blocks, cfg.block_size, kv_memory)
        self.eos_token_ids = sorted(set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids))
        self.sampler = Sampler(self.eos_token_ids, self.model_config.vocab_size, cfg.seed)
        self.requests: dict[str, Request] = {}
        self.pinned: dict[str, list[int]] = {}          # prefill-only request id -> blocks held for a handoff
        # Reserved blocks a transfer may still write into although their request is gone (aborted,
        # or given up on): they return to the pool only when the transfer settles.
        self.quarantine: dict[str, list[int]] = {}
        self._done_at_once: list[RequestOutput] = []    # finished at admission, reported by the next step
        # The last step could run nothing (waiting requests, no room for any) and changed nothing:
        # only something from outside (blocks freed, a request added or aborted) can change that.
        self.stalled = False
        # Finished `retain` requests' KV, least recently used first. Evicted (on_evict told) whenever a
        # request needs the blocks: running requests always win over retained history.
        self.retained: OrderedDict[str, RetainedKV] = OrderedDict()
        self.on_evict: Callable[[str], None] | None = None
        log.info("engine ready: model=%s device=%s dtype=%s blocks=%d x %d tokens (%.1f MiB KV)",
                 self.served_name, self.device, str(self.dtype).removeprefix("torch."), num_blocks,
                 cfg.block_size, num_blocks * self.block_bytes / 2**20)

    # ---- pool facts -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, with what to fix, for a request this engine can never serve."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; send at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request needs "
                f"{total} ({len(prompt_token_ids)} prompt + {params.max_tokens} max_tokens); shorten the "
                f"prompt or lower max_tokens")
        if self.scheduler.blocks_for(total) > self.pool.num_blocks:
            raise ValueError(f"the request needs {self.scheduler.blocks_for(total)} KV blocks but the pool has "
                             f"{self.pool.num_blocks}; shorten the prompt or lower max_tokens")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival: float | None = None, prefill_only: bool = False, retain: bool = False,
                    preloaded: tuple[str, int] | None = None) -> Request:
        """Queue a request. `prefill_only`: compute the whole prompt's KV, sample the first token (so
        it comes from the same computation as colocated: same chunks, same rounding) and finish with
        reason "prefilled", the blocks pinned until release_pinned(). `retain`: keep the KV after a
        normal finish (see retained). `preloaded=(pin_id, num_tokens)`: the blocks pinned under
        `pin_id` (allocate_pinned) already hold the K/V of the first `num_tokens` prompt tokens
        (fetched from another worker): they become the request's, and only the rest is computed."""
        try:
            request = self._new_request(request_id, prompt_token_ids, params, arrival)
        except ValueError:
            if preloaded is not None:
                self.release_pinned(preloaded[0])       # refused: the fetched blocks go back
            raise
        request.prefill_only, request.retain = prefill_only, retain
        if preloaded is not None:
            pin_id, num_tokens = preloaded
            assert 0 < num_tokens < len(prompt_token_ids), "at least one prompt token must be computed here"
            request.block_table = self.pinned.pop(pin_id)
            assert len(request.block_table) == self.scheduler.blocks_for(num_tokens)
            self.scheduler.preloaded(request, num_tokens)
        self.scheduler.add(request)
        return request

    def _new_request(self, request_id, prompt_token_ids, params, arrival) -> Request:
        if request_id in self.requests or request_id in self.pinned:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params)
        if arrival is not None:
            request.timings.arrival = arrival
        self.requests[request_id] = request
        return request

    # ---- disaggregation hooks (called on the engine thread by a handoff connector) -------------
    def reserve_for_remote_kv(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                              num_kv_tokens: int, arrival: float | None = None,
                              retain: bool = False) -> list[int] | None:
        """Allocate blocks for `num_kv_tokens` of K/V that another worker will deliver; the request
        waits in WAITING_FOR_KV. Returns the block ids, or None (nothing changed) if the pool is
        too full right now. The first `num_cached_tokens // block_size` of them (the request's
        num_cached_tokens) already hold the right K/V, from this worker's prefix cache."""
        assert 0 < num_kv_tokens <= len(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        # Full blocks this worker already holds (its prefix cache, e.g. a conversation's retained
        # history) need not travel; at least the last block always does.
        local = self.pool.match_prefix(hash_chain(prompt_token_ids[:num_kv_tokens - 1], self.block_size))
        need = self.scheduler.blocks_for(num_kv_tokens) - len(local)
        if not self.make_room(need):
            self.pool.free_blocks(local)
            return None
        try:
            request = self._new_request(request_id, prompt_token_ids, params, arrival)
        except ValueError:
            self.pool.free_blocks(local)
            raise
        request.retain = retain
        request.block_table = local + self.pool.allocate(need)
        request.num_cached_tokens = len(local) * self.block_size
        request.state = RequestState.WAITING_FOR_KV
        self.scheduler.add(request)
        return list(request.block_table)

    def kv_ready(self, request_id: str, num_kv_tokens: int, first_token: int | None = None) -> RequestOutput | None:
        """The reserved blocks now hold verified K/V: schedule the request for decoding. With the whole
        prompt's K/V comes the first token the prefill sampled: it is emitted now (the client's first
        token does not wait for a decode step) and the next step decodes after it. (If the request was
        aborted meanwhile, its blocks were only waiting for the transfer to settle: free them.)"""
        request = self.requests.get(request_id)
        if request is None:
            self.settle(request_id)
            return None
        self.scheduler.kv_arrived(request, num_kv_tokens)
        if first_token is None:
            assert num_kv_tokens < request.num_prompt_tokens, "a whole prompt's K/V comes with its first token"
            return None
        assert num_kv_tokens == request.num_prompt_tokens
        self.sampler.skip(request)      # the prefill drew the first token from this request's stream
        return self._append_token(request, first_token, time.monotonic())

    def kv_failed(self, request_id: str, recompute: bool, reason: str, settled: bool = True) -> RequestOutput | None:
        """The K/V will not arrive, or failed verification: recompute the prompt here, or end the
        request with an error naming `reason`. `settled=False` when a transfer might still write into
        the reserved blocks (a peer that went quiet): they stay out of the pool until settle()."""
        request = self.requests.get(request_id)
        if request is None:                 # aborted while waiting: nothing left but the blocks
            if settled:
                self.settle(request_id)
            return None
        assert request.state is RequestState.WAITING_FOR_KV
        self._set_aside(request, settled)
        if not recompute:
            return self._finish(request, FinishReason.ERROR, reason)
        del self.scheduler.waiting_for_kv[request_id]
        request.state = RequestState.WAITING
        self.scheduler.add(request)
        return None

    def settle(self, request_id: str) -> None:
        """No transfer can touch this request's reserved blocks any more: free them if set aside."""
        blocks = self.quarantine.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(blocks)

    def _set_aside(self, request: Request, settled: bool) -> None:
        if not settled:
            self.quarantine[request.request_id] = request.block_table
        else:
            self.pool.free_blocks(request.block_table)
        request.block_table = []

    def release_pinned(self, request_id: str) -> None:
        """Give back the blocks of a finished prefill-only request (after the handoff or its lease)."""
        self.pool.free_blocks(self.pinned.pop(request_id))

    def allocate_pinned(self, pin_id: str, num_blocks: int) -> list[int] | None:
        """Blocks for K/V fetched from elsewhere (a reverse read), pinned under `pin_id` until
        add_request(preloaded=...) takes them or release_pinned() returns them; None if the pool
        cannot spare them (retained history is evicted first)."""
        assert pin_id not in self.pinned and num_blocks > 0
        if not self.make_room(num_blocks):
            return None
        self.pinned[pin_id] = self.pool.allocate(num_blocks)
        return list(self.pinned[pin_id])

    # ---- retained KV (bidirectional reuse) -----------------------------------------------------
    def _retain(self, request: Request) -> RetainedKV:
        """Keep a finished request's blocks: they hold the K/V of every token it computed."""
        n = request.num_computed_tokens
        keep = self.scheduler.blocks_for(n)
        self.pool.free_blocks(request.block_table[keep:])       # nothing computed in them
        tokens = request.all_token_ids[:n]
        entry = RetainedKV(request.request_id, request.block_table[:keep], tokens, hash_chain(tokens, self.block_size))
        self.retained[entry.retention_id] = entry
        return entry

    def release_retained(self, retention_id: str) -> bool:
        entry = self.retained.pop(retention_id, None)
        if entry is None:
            return False
        self.pool.free_blocks(entry.block_ids)
        return True

    def make_room(self, num_blocks: int) -> bool:
        """Are `num_blocks` blocks free, once retained KV has been evicted for them if need be (least
        recently used first; blocks under a reverse read stay)?"""
        for retention_id in list(self.retained):
            if self.pool.num_free >= num_blocks:
                break
            if self.retained[retention_id].readers == 0:
                self.release_retained(retention_id)
                if self.on_evict is not None:
                    self.on_evict(retention_id)
        return self.pool.num_free >= num_blocks

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.state is RequestState.WAITING_FOR_KV:
            # A transfer may be writing into its blocks right now: set them aside until it settles.
            self._set_aside(request, settled=False)
        return self._finish(request, FinishReason.ABORT)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._done_at_once)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        done, self._done_at_once = self._done_at_once, []
        num_preemptions = self.scheduler.num_preemptions
        chunks = self.scheduler.schedule()
        # (A step that preempted everyone freed blocks: the next one may admit someone.)
        self.stalled = not chunks and self.scheduler.num_preemptions == num_preemptions
        if not chunks:
            return done
        now = time.monotonic()
        for chunk in chunks:
            if chunk.request.timings.first_scheduled is None:
                chunk.request.timings.first_scheduled = now
        try:
            logits = self.runner.run(chunks)
        except Exception as exc:       # a failed forward must not take the server down or leak blocks
            log.exception("forward pass failed")
            return done + [self._finish(c.request, FinishReason.ERROR, f"forward pass failed: {exc}") for c in chunks]
        sampling = [c.request for c in chunks if c.samples]
        token_ids = self.sampler.sample(logits, sampling) if sampling else []
        self.scheduler.after_step(chunks)
        now = time.monotonic()
        for request, token in zip(sampling, token_ids):
            if request.prefill_only:        # the KV and the first token go to a decode worker
                request.timings.first_token = now
                done.append(self._finish(request, FinishReason.PREFILLED, new_token_ids=[token], keep_blocks=True))
            else:
                done.append(self._append_token(request, token, now))
        return done

    def _append_token(self, request: Request, token: int, now: float) -> RequestOutput:
        if request.timings.first_token is None:
            request.timings.first_token = now
        elif request.timings.second_token is None:
            request.timings.second_token = now
        request.output_token_ids.append(token)
        params, n_out = request.params, len(request.output_token_ids)
        reason = None
        is_stop_token = token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)
        if is_stop_token and n_out >= params.min_tokens:
            reason = FinishReason.STOP
        elif n_out >= params.max_tokens or request.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        new_text, stopped = self._detokenize(request, final=reason is not None)
        if stopped:
            reason = FinishReason.STOP
        if reason is not None:
            return self._finish(request, reason, new_token_ids=[token], new_text=new_text)
        return RequestOutput(request.request_id, [token], new_text, False, None, request.num_prompt_tokens,
                             n_out, request.num_cached_tokens)

    def _detokenize(self, request: Request, final: bool) -> tuple[str, bool]:
        """New text to emit, and whether a stop string was found (text is cut before it).

        Text that could be the start of a stop string, or an incomplete UTF-8 character, is held
        back until the next token settles it.
        """
        text = self.tokenizer.decode(request.output_token_ids)
        stops = request.params.stop
        if stops:
            search_from = max(0, request.emitted_chars - max(map(len, stops)) + 1)
            hits = [i for i in (text.find(s, search_from) for s in stops) if i >= 0]
            if hits:
                cut = min(hits)
                new = text[request.emitted_chars:cut]
                request.output_text, request.emitted_chars = text[:cut], cut
                return new, True
        safe = len(text)
        if not final:
            if text.endswith("\ufffd"):
                safe = len(text.rstrip("\ufffd"))
            if stops:
                safe = min(safe, len(text) - max(map(len, stops)) + 1)
        safe = max(safe, request.emitted_chars)
        new = text[request.emitted_chars:safe]
        request.output_text, request.emitted_chars = text, safe
        return new, False

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None,
                new_token_ids: list[int] | None = None, new_text: str = "",
                keep_blocks: bool = False) -> RequestOutput:
        retain = request.retain and reason in (FinishReason.STOP, FinishReason.LENGTH) and request.num_computed_tokens > 0
        num_cached = request.num_cached_tokens          # (freeing the blocks resets it)
        self.scheduler.finish(request, reason, keep_blocks=keep_blocks or retain)
        self.sampler.forget(request.request_id)
        self.requests.pop(request.request_id, None)
        request.timings.finished = time.monotonic()
        out = RequestOutput(request.request_id, new_token_ids or [], new_text, True, reason.value,
                            request.num_prompt_tokens, len(request.output_token_ids),
                            num_cached, request.timings.as_ms(), error)
        if keep_blocks:
            self.pinned[request.request_id] = request.block_table
            out.kv_block_ids, out.num_kv_tokens = list(request.block_table), request.num_computed_tokens
        elif retain:
            out.retained = self._retain(request)
        return out

    # ---- offline use --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion (all admitted at once); return each one's output token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.add_request(request_id, prompt, p)
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        pending = set(ids)
        while pending:
            for out in self.step():
                outputs[out.request_id] += out.new_token_ids
                if out.finished:
                    if out.finish_reason == FinishReason.ERROR.value:
                        raise RuntimeError(out.error)
                    pending.discard(out.request_id)
        return [outputs[i] for i in ids]
