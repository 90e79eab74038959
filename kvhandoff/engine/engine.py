"""LLMEngine: requests in, tokens and text out, one scheduling step at a time (no threads here).

It wires the loaded model, the block pool, the scheduler, the runner and the sampler together,
applies stop conditions and turns tokens into text incrementally. The thread that drives `step()`
for a server lives in kvhandoff.engine.loop.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from kvhandoff.config import EngineConfig
from kvhandoff.engine.block_pool import BlockPool, hash_chain
from kvhandoff.engine.detokenizer import detokenize
from kvhandoff.engine.holds import Hold, Holdings, set_aside_owner
from kvhandoff.engine.kv_connector import KVConnector, KVEvents
from kvhandoff.engine.request import (FinishReason, Request, RequestOutput, RequestState, Resume, RetainedKV,
                                      SamplingParams)
from kvhandoff.engine.runner import ModelRunner, kv_block_bytes
from kvhandoff.engine.sampler import Sampler
from kvhandoff.engine.scheduler import Scheduler
from kvhandoff.model import kernels
from kvhandoff.model.loader import load_model

log = logging.getLogger(__name__)


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: PyTorch's bf16 matmuls then beat fp32 several times over on this CPU."""
    flags = kernels.cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_device_dtype(cfg: EngineConfig) -> tuple[torch.device, torch.dtype, str]:
    """(device, dtype, why that dtype): the reason goes to /health, benchmarks and the start-up line."""
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if cfg.device == "auto" else cfg.device))
    if cfg.dtype != "auto":
        return device, getattr(torch, cfg.dtype), f"--dtype {cfg.dtype}"
    # Measured side by side (python -m kvhandoff.bench.engine --dtypes-compare, one thread, SmolLM2,
    # 1,024 tokens, 2-core AMD EPYC with AVX512-BF16, 2026-12-03): bf16 prefill on torch's native bf16
    # matmuls 2.2 s against 4.1 s for fp32 through our kernels, bf16 decode through our kernels 21 ms
    # a token against 36.5. Without bf16 instructions torch's bf16 matmuls are emulated and the
    # prefill crawls: fp32 there.
    if device.type == "cuda":
        return device, torch.bfloat16, "auto: bf16 on CUDA"
    if cpu_has_fast_bf16():
        return device, torch.bfloat16, "auto: this CPU has bf16 instructions (avx512_bf16 or amx_bf16): bf16 is faster"
    return device, torch.float32, "auto: no bf16 instructions on this CPU (bf16 matmuls would be emulated): fp32"


class LLMEngine:
    def __init__(self, cfg: EngineConfig, kv_allocator=None):
        """`kv_allocator(nbytes) -> uint8 tensor`, if given, provides the KV pool's memory (a worker
        passes its transfer agent's shared-memory allocator so peers can copy blocks directly).

        The engine computes with `self.threads` torch threads on the thread that steps it: EngineLoop
        sets them on its own thread. This (loading) thread is left with one. Two OpenMP teams, the
        loading thread's and the loop's, were more threads than a 2-core machine has cores, and
        libgomp then stops spinning between parallel regions: a bf16 SmolLM2 decode step slept and
        woke its threads ~500 times (122k voluntary context switches over 240 tokens) and took 95-136
        ms with two threads, against 54-68 ms with the loop on the loading thread and 61-75 ms with one
        thread (2-core AMD EPYC, 2026-12-03). A caller that steps the engine itself sets
        torch.set_num_threads(engine.threads) on its own thread first."""
        self.cfg = cfg
        self.threads = cfg.threads or torch.get_num_threads()
        torch.set_num_threads(1)
        self.device, self.dtype, self.dtype_reason = pick_device_dtype(cfg)
        model_len = cfg.max_model_len or None
        self.loaded = load_model(cfg.model, dtype=self.dtype, device=self.device, max_positions=model_len)
        self.kernels = self._use_kernels()
        # Greedy output the same whatever shares a step, however a prompt is chunked (or recomputed):
        # what lets disaggregated output equal colocated's under any load.
        self.batch_invariant = self.loaded.model.batch_invariant(cfg.block_size)
        self.tokenizer = self.loaded.tokenizer
        self.served_name = self.loaded.served_name
        self.model_config = self.loaded.config
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        self.block_size = cfg.block_size
        self.block_bytes = kv_block_bytes(self.model_config, cfg.block_size, self.dtype)
        num_blocks = cfg.num_blocks or max(1, cfg.kv_cache_bytes // self.block_bytes)
        self.pool = BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.connector = KVConnector()          # a handoff connector replaces it (connect())
        self.scheduler = Scheduler(cfg, self.pool, make_room=self.make_room, connector=self.connector)
        kv_memory = None if kv_allocator is None else kv_allocator(num_blocks * self.block_bytes)
        self.runner = ModelRunner(self.loaded.model, num_blocks, cfg.block_size, kv_memory)
        self.eos_token_ids = sorted(set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids))
        self.sampler = Sampler(self.eos_token_ids, self.model_config.vocab_size, cfg.seed)
        self.requests: dict[str, Request] = {}
        self.holds = Holdings()                         # blocks kept past their request (holds.py)
        # The last step could run nothing (waiting requests, no room for any) and changed nothing:
        # only something from outside (blocks freed, a request added or aborted) can change that.
        self.stalled = False
        # Seconds spent in the model's forward pass, of all steps so far: a step's time beyond it
        # is the engine's overhead (scheduling, batch building, sampling, detokenization).
        self.forward_s = 0.0
        # Told when retained KV is evicted because a request needed the blocks.
        self.on_evict: Callable[[str], None] | None = None
        log.info("engine ready: model=%s device=%s dtype=%s (%s) threads=%d kernels=%s batch-invariant=%s blocks=%d x "
                 "%d tokens (%.1f MiB KV)", self.served_name, self.device, str(self.dtype).removeprefix("torch."),
                 self.dtype_reason, self.threads, self.kernels, self.batch_invariant, num_blocks, cfg.block_size,
                 num_blocks * self.block_bytes / 2**20)

    def compute_facts(self) -> dict:
        """What this engine computes with, as chosen for this machine (reported by /health and benchmarks)."""
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "dtype_reason": self.dtype_reason, "threads": self.threads, "kernels": self.kernels,
                "batch_invariant": self.batch_invariant}

    def _use_kernels(self) -> str:
        """Switch the model to the compiled CPU kernels where they apply; say which path serves."""
        if not self.cfg.cpu_kernels:
            return "off (cpu_kernels disabled)"
        dtype = str(self.dtype).removeprefix("torch.")
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            return f"off (they cover fp32 and bf16 on CPU; this engine runs {dtype} on {self.device.type})"
        cfg = self.loaded.model.cfg
        if self.dtype == torch.bfloat16 and kernels.available() and \
                not kernels.bf16_supported(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size):
            return "off (bf16: a layer's width is not a multiple of 8)"
        if kernels.available():
            model = self.loaded.model
            model.use_cpu_kernels()
            prompts = "prompts row by row like decode rows" if model.batch_invariant(self.cfg.block_size) \
                else "prompts on torch"
            return f"{kernels.status()}: {'bf16' if self.dtype == torch.bfloat16 else 'fp32'}, {prompts}"
        return kernels.status()

    def connect(self, connector: KVConnector) -> None:
        """Hand remote K/V and finished prefills to `connector` (before the engine runs)."""
        assert not self.requests, "connect the connector before any request arrives"
        self.connector = self.scheduler.connector = connector

    # ---- pool facts -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams, resume: Resume | None = None) -> None:
        """Raise ValueError, with what to fix, for a request this engine can never serve."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; send at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if resume is not None:
            bad = next((t for t in resume.output_token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"resumed output token id {bad} is outside the vocabulary [0, {vocab})")
            if not 0 < len(resume.output_token_ids) < params.max_tokens:
                raise ValueError(f"a resumed generation needs between 1 and max_tokens - 1 ({params.max_tokens - 1}) "
                                 f"tokens already generated, not {len(resume.output_token_ids)}")
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
                    remote_tokens: int = 0, resume: Resume | None = None) -> Request:
        """Queue a request. `prefill_only`: compute the whole prompt's KV, sample the first token (so
        it comes from the same computation as colocated: same chunks, same rounding) and finish with
        reason "prefilled", the blocks held (Hold.PINNED) for the connector. `retain`: keep the KV
        after a normal finish (Hold.RETAINED). `remote_tokens`: the K/V of the first that many
        prompt tokens comes from another worker through the connector (the whole prompt: it comes
        with the first token, and the request decodes; fewer: the rest is computed here). `resume`: the
        generation continues after tokens another worker produced (their K/V is computed here as the
        prompt's is, as after a preemption)."""
        if request_id in self.requests or request_id in self.holds:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params, resume)
        request = Request(request_id, list(prompt_token_ids), params, prefill_only=prefill_only, retain=retain,
                          remote_tokens=remote_tokens)
        if resume is not None:
            request.output_token_ids, request.emitted_chars = list(resume.output_token_ids), resume.emitted_chars
            for _ in resume.output_token_ids:       # a seeded stream continues where the first worker was
                self.sampler.skip(request)
        if arrival is not None:
            request.timings.arrival = arrival
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    # ---- remote K/V (the connector's events, applied on the engine thread by step()) -----------
    def kv_ready(self, request_id: str, first_token: int | None = None) -> RequestOutput | None:
        """The reserved blocks now hold verified K/V: schedule the request. With a whole prompt's K/V
        comes the first token the prefill sampled: it is emitted now (the client's first token does
        not wait for a decode step) and the next step decodes after it. (If the request was aborted
        meanwhile, its blocks were only set aside for the transfer: free them.)"""
        request = self.requests.get(request_id)
        if request is None or request.state is not RequestState.WAITING_FOR_KV:
            self.release(set_aside_owner(request_id))
            return None
        self.scheduler.kv_arrived(request)
        if request.remote_tokens < request.num_prompt_tokens:
            return None
        assert first_token is not None, "a whole prompt's K/V comes with its first token"
        self.sampler.skip(request)      # the prefill drew the first token from this request's stream
        return self._append_token(request, first_token, time.monotonic())

    def kv_failed(self, request_id: str, recompute: bool, reason: str, settled: bool = True) -> RequestOutput | None:
        """The K/V will not arrive, or failed verification: compute the request here, or end it
        with an error naming `reason`. `settled=False` when a transfer might still write into the
        reserved blocks (a peer that went quiet): they are set aside until released."""
        request = self.requests.get(request_id)
        if request is None or request.state not in (RequestState.WAITING_REMOTE, RequestState.WAITING_FOR_KV):
            if settled:                 # aborted while waiting: nothing left but the blocks, if any
                self.release(set_aside_owner(request_id))
            return None
        blocks = self.scheduler.remote_lost(request)
        self._set_aside(request_id, blocks, settled)
        return None if recompute else self._finish(request, FinishReason.ERROR, reason)

    def _set_aside(self, request_id: str, blocks: list[int], settled: bool) -> None:
        if settled or not blocks:
            self.pool.free_blocks(blocks)
        else:
            self.holds.hold(set_aside_owner(request_id), Hold.SET_ASIDE, blocks)

    def release(self, owner: str) -> bool:
        """Give back what `owner` holds (holds.py); False if it holds nothing."""
        held = self.holds.release(owner)
        if held is None:
            return False
        self.pool.free_blocks(held.block_ids)
        return True

    # ---- retained KV (bidirectional reuse) -----------------------------------------------------
    def _retain(self, request: Request, blocks: list[int]) -> RetainedKV:
        """Keep a finished request's blocks: they hold the K/V of every token it computed."""
        n = request.num_computed_tokens
        keep = self.scheduler.blocks_for(n)
        self.pool.free_blocks(blocks[keep:])        # nothing computed in them
        tokens = request.all_token_ids[:n]
        entry = RetainedKV(request.request_id, blocks[:keep], tokens, hash_chain(tokens, self.block_size))
        self.holds.hold(entry.retention_id, Hold.RETAINED, entry.block_ids, retained=entry)
        return entry

    def retained(self, retention_id: str) -> RetainedKV | None:
        held = self.holds.get(retention_id, Hold.RETAINED)
        return None if held is None else held.retained

    def make_room(self, num_blocks: int) -> bool:
        """Are `num_blocks` blocks free, once retained KV has been evicted for them if need be (least
        recently used first; blocks under a reverse read stay)?"""
        for held in self.holds.of(Hold.RETAINED):
            if self.pool.num_free >= num_blocks:
                break
            if held.retained.readers == 0:
                self.release(held.owner)
                if self.on_evict is not None:
                    self.on_evict(held.owner)
        return self.pool.num_free >= num_blocks

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.state is RequestState.WAITING_FOR_KV:
            # A transfer may be writing into its blocks right now: set them aside until it settles.
            blocks = self.scheduler.remote_lost(request)
            self._set_aside(request_id, blocks, settled=False)
        return self._finish(request, FinishReason.ABORT)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.connector.has_events()

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: the connector's finished transfers, scheduling (decode, prefill, remote-KV
        admission), the transfers those reservations need, the forward pass, sampling."""
        events = self.connector.poll()
        done = self._apply(events)
        num_preemptions, num_reserved = self.scheduler.num_preemptions, self.scheduler.num_reserved
        chunks = self.scheduler.schedule()
        self.connector.start_loads()
        # Nothing ran and nothing changed: only something from outside can change that. (A step
        # that preempted everyone freed blocks, one that reserved blocks started a transfer.)
        self.stalled = not chunks and not events and self.scheduler.num_preemptions == num_preemptions \
            and self.scheduler.num_reserved == num_reserved
        if not chunks:
            return done
        now = time.monotonic()
        for chunk in chunks:
            if chunk.request.timings.first_scheduled is None:
                chunk.request.timings.first_scheduled = now
        try:
            forward_started = time.perf_counter()
            logits = self.runner.run(chunks, self.connector.layer_hook(chunks))
            self.forward_s += time.perf_counter() - forward_started
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
                done.append(self._prefilled(request, token))
            else:
                done.append(self._append_token(request, token, now))
        return done

    def _prefilled(self, request: Request, token: int) -> RequestOutput:
        """A prefill-only request's end: its first token, with the text colocated serving would
        stream for it (the router sends it to the client at once; the decode worker, which appends
        the same token to the same state, continues the text exactly after it)."""
        request.output_token_ids.append(token)
        new_text, _ = detokenize(self.tokenizer, request, final=self._stop_reason(request, token) is not None)
        return self._finish(request, FinishReason.PREFILLED, new_token_ids=[token], new_text=new_text)

    def _apply(self, events: KVEvents) -> list[RequestOutput]:
        outputs = [self.kv_ready(e.request_id, e.first_token) for e in events.landed]
        outputs += [self.kv_failed(e.request_id, e.recompute, e.reason, e.settled) for e in events.lost]
        for owner in events.release:
            self.release(owner)
        return [out for out in outputs if out is not None]

    def _append_token(self, request: Request, token: int, now: float) -> RequestOutput:
        if request.timings.first_token is None:
            request.timings.first_token = now
        elif request.timings.second_token is None:
            request.timings.second_token = now
        request.output_token_ids.append(token)
        reason = self._stop_reason(request, token)
        new_text, stopped = detokenize(self.tokenizer, request, final=reason is not None)
        if stopped:
            reason = FinishReason.STOP
        if reason is not None:
            return self._finish(request, reason, new_token_ids=[token], new_text=new_text)
        return RequestOutput(request.request_id, [token], new_text, False, None, request.num_prompt_tokens,
                             len(request.output_token_ids), request.num_cached_tokens)

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        """Does the token just appended end the request (a stop token, the length)? Stop strings are
        the detokenizer's to find."""
        params, n_out = request.params, len(request.output_token_ids)
        is_stop_token = token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)
        if is_stop_token and n_out >= params.min_tokens:
            return FinishReason.STOP
        if n_out >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None,
                new_token_ids: list[int] | None = None, new_text: str = "") -> RequestOutput:
        """End a request. A prefill-only one's blocks are held for the connector (Hold.PINNED,
        under its id) unless the connector declines them; a `retain` one's are retained."""
        pin = reason == FinishReason.PREFILLED
        retain = request.retain and reason in (FinishReason.STOP, FinishReason.LENGTH) and request.num_computed_tokens > 0
        blocks, num_cached = request.block_table, request.num_cached_tokens     # (freeing resets them)
        self.scheduler.finish(request, reason, keep_blocks=pin or retain)
        self.sampler.forget(request.request_id)
        self.requests.pop(request.request_id, None)
        request.timings.finished = time.monotonic()
        out = RequestOutput(request.request_id, new_token_ids or [], new_text, True, reason,
                            request.num_prompt_tokens, len(request.output_token_ids),
                            num_cached, request.timings.as_ms(len(request.output_token_ids)), error)
        if pin:
            self.holds.hold(request.request_id, Hold.PINNED, blocks)
            out.kv_block_ids, out.num_kv_tokens = list(blocks), request.num_computed_tokens
        elif retain:
            out.retained = self._retain(request, blocks)
        if not self.connector.finished(request, out) and pin:
            self.release(request.request_id)
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
                    if out.finish_reason == FinishReason.ERROR:
                        raise RuntimeError(out.error)
                    pending.discard(out.request_id)
        return [outputs[i] for i in ids]
