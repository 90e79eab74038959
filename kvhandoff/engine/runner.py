"""The model runner: owns the KV pool tensor, turns scheduled chunks into one flat batch, runs it.

Rows are laid out prefill chunks first, then one row per single-token chunk (decode), because the
model attends to the two kinds differently (see kvhandoff.model.llama).
"""
from __future__ import annotations

import math
import threading
from typing import Callable

import torch

from kvhandoff.config import ModelConfig
from kvhandoff.engine.scheduler import ScheduledChunk
from kvhandoff.model import kernels, paired_kv
from kvhandoff.model.llama import BatchMetadata, LlamaModel, PrefillSeq
from kvhandoff.model.pages import populate_in_background


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return block_size * cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_memory: torch.Tensor | None = None):
        self.model, self.cfg, self.block_size = model, model.cfg, block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = self.cfg
        paired_kv.check_block_size(self.dtype, block_size)
        # Layer-major (kvhandoff.model.llama): one layer's blocks side by side, so that a sequence's
        # adjacent blocks are one stream for its attention to read.
        shape = (cfg.num_layers, num_blocks, 2, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.populating: threading.Thread | None = None
        if kv_memory is None and self.device.type == "cpu":
            # On huge pages where the kernel gives them: a decode step reads every sequence's blocks
            # (16 sequences at 1,024 tokens of SmolLM2: 4-8% faster a step). Committed on a thread
            # of its own while the rest of the start goes on, and waited for at its end
            # (wait_populated), so that no request pays for a page. On a VM whose host takes back
            # the memory its guest frees, fresh 2 MiB pages came at ~160 MB/s (a 512 MiB pool:
            # 3.3 s), where pages the guest had just freed took 0.05 s.
            memory = kernels.streamed_memory(math.prod(shape), self.dtype)
            self.populating = populate_in_background(memory.view(torch.uint8).numpy(), read_fallback=False)
            self.kv_cache = memory.view(shape)
        elif kv_memory is None:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        else:   # caller-provided bytes, e.g. a shared-memory region registered with a transfer agent
            self.kv_cache = kv_memory.view(self.dtype).view(shape)

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Block until every page of the pool is in (True), or `timeout` passes (False)."""
        if self.populating is not None:
            self.populating.join(timeout)
        return self.populating is None or not self.populating.is_alive()

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run one step, calling layer_done(layer) after each layer (layer-wise handoff).
        Returns logits [n, vocab] for the chunks that sample a token, in the order they appear in
        `chunks`."""
        prefills = [c for c in chunks if c.num_new_tokens > 1]
        decodes = [c for c in chunks if c.num_new_tokens == 1]
        bs = self.block_size
        token_ids, positions, slot_block, seqs, last_row = [], [], [], [], {}
        for chunk in prefills + decodes:
            request, start = chunk.request, chunk.request.num_computed_tokens
            end = start + chunk.num_new_tokens
            row = len(token_ids)
            token_ids += request.all_token_ids[start:end]
            positions += range(start, end)
            slot_block += (request.block_table[p // bs] for p in range(start, end))
            if chunk.num_new_tokens > 1:
                table = torch.tensor(request.block_table[:-(-end // bs)], dtype=torch.long, device=self.device)
                seqs.append(PrefillSeq(row, row + chunk.num_new_tokens, end, table))
            last_row[id(chunk)] = len(token_ids) - 1
        # Built as tensors straight from lists: a decode step's torch operations run from cold caches
        # (the weights just streamed through them), so each one avoided counts (FusedDecode).
        meta = BatchMetadata(slot_block=self._tensor(slot_block), slot_offset=self._tensor([p % bs for p in positions]),
                             prefills=seqs, num_prefill_tokens=sum(c.num_new_tokens for c in prefills))
        if decodes:
            self._decode_metadata(meta, decodes)
        hidden = self.model(self._tensor(token_ids), self._tensor(positions), meta, self.kv_cache, layer_done)
        rows = [last_row[id(c)] for c in chunks if c.samples]
        if rows != list(range(hidden.shape[0])):        # (a decode-only step samples every row, in order)
            hidden = hidden[rows]
        return self.model.logits(hidden)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _decode_metadata(self, meta: BatchMetadata, decodes: list[ScheduledChunk]) -> None:
        context_lens = [c.request.num_computed_tokens + 1 for c in decodes]
        max_blocks = -(-max(context_lens) // self.block_size)
        block_ids = []       # padded with block 0: attention stops at each row's length
        for chunk in decodes:
            table = chunk.request.block_table[:max_blocks]
            block_ids += table + [0] * (max_blocks - len(table))
        meta.decode_block_ids = self._tensor(block_ids)
        meta.decode_context_lens = self._tensor(context_lens)
