"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3) over a paged KV pool.

The KV pool is one tensor, layer-major: [num_layers, num_blocks, 2 (K, V), kv_heads, block_size,
head_dim]. One layer of one block (its K, then its V) is a contiguous range, and a layer's adjacent
blocks are adjacent ranges, so the blocks of a sequence that were handed out together are one
stream for its attention to read (kernels.FusedDecode; the transfer layer moves a block as a range
per layer, worker/kv_layout.py); inside a range, one head's K (or V) for the block's tokens is a
contiguous range of block_size x head_dim (token-major, or in bf16 paired as paired_kv says):
kernels.paged_attention reads it in place, and torch's path (Attention._decode, the reference)
gathers a sequence's K of one head into a contiguous matrix with one index_select (and, in bf16,
one copy back to token order). Linear layers are nn.Linear until use_cpu_kernels() re-lays them
for kernels.gemm_packed (fp32 on CPU). A forward pass takes a flat batch of tokens (prefill chunks
first, then one token per decoding sequence), writes their K/V into the pool at (slot_block,
slot_offset), and attends over each sequence's blocks.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvhandoff.config import ModelConfig
from kvhandoff.model import kernels, paired_kv


@dataclass
class PrefillSeq:
    """One sequence's prefill chunk inside the flat batch."""
    start: int                  # first row of this chunk in the flat batch
    end: int                    # one past the last row
    context_len: int            # tokens in the sequence once this chunk is written (cached + chunk)
    block_table: torch.Tensor   # [num_blocks] block ids covering context_len


@dataclass
class BatchMetadata:
    slot_block: torch.Tensor            # [T] block id for each new token
    slot_offset: torch.Tensor           # [T] offset inside that block
    prefills: list[PrefillSeq] = field(default_factory=list)
    num_prefill_tokens: int = 0
    decode_block_ids: torch.Tensor | None = None      # [B * max_blocks]: each sequence's blocks, padded
    decode_context_lens: torch.Tensor | None = None   # [B] int64: tokens each decoding sequence attends to


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, as the reference implementations do, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.float()


class Rotary(nn.Module):
    """Rotate-half RoPE (the Hugging Face layout; GGUF loaders undo llama.cpp's permutation).

    The rotation runs in the model's dtype with cos/sin cast to it, as Hugging Face does, so bf16
    results match theirs bit for bit.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
        # Plain attributes, not buffers: model.to(bfloat16) must not round the tables (positions
        # beyond a few hundred would lose precision); they follow the positions' device on use.
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions`, shaped to broadcast over [T, heads, head_dim // 2]; once per step."""
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = rope
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        self.paged_kernel = False       # attention through kernels.paged_attention (LlamaModel.use_cpu_kernels)

    def forward(self, x, rope, meta: BatchMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache[self.layer, :, 0], kv_cache[self.layer, :, 1]     # [blocks, kv_heads, bs, D]
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.paged_kernel and self.q_norm is None:
            # One call rotates q and k in place and stores K and V in the pool.
            kernels.rope_store_kv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope, k_cache, v_cache,
                                  meta.slot_block, meta.slot_offset)
            q = qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        else:
            q, k = self._rotate(qkv, rope)
            paired_kv.store(k_cache, meta.slot_block, meta.slot_offset, k, keys=True)
            paired_kv.store(v_cache, meta.slot_block, meta.slot_offset, v, keys=False)
        out = torch.empty_like(q)
        for seq in meta.prefills:
            out[seq.start:seq.end] = self._prefill(q[seq.start:seq.end], k[seq.start:seq.end],
                                                   v[seq.start:seq.end], seq, k_cache, v_cache)
        if meta.decode_block_ids is not None:
            P = meta.num_prefill_tokens
            if self.paged_kernel and kernels.attention_supported(self.num_heads, self.num_kv_heads, self.head_dim,
                                                                 k_cache.shape[2]):
                tables = meta.decode_block_ids.view(T - P, -1)
                out[P:] = kernels.paged_attention(q[P:], k_cache, v_cache, tables, None, meta.decode_context_lens,
                                                  self.scale)
            else:
                out[P:] = self._decode(q[P:], meta, k_cache, v_cache)
        return self.o_proj(out.view(T, self.q_size))

    def _rotate(self, qkv, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k of qkv with RoPE applied (after q/k norms where the model has them), in torch."""
        T = qkv.shape[0]
        if self.q_norm is None:
            # q and k sit side by side in each row: rotate both heads-sets in one pass.
            qk = Rotary.rotate(qkv[:, :self.q_size + self.kv_size].view(T, -1, self.head_dim), rope)
            return qk.split([self.num_heads, self.num_kv_heads], dim=1)
        q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
        q = Rotary.rotate(self.q_norm(q.view(T, self.num_heads, self.head_dim)), rope)
        k = Rotary.rotate(self.k_norm(k.view(T, self.num_kv_heads, self.head_dim)), rope)
        return q, k

    def _prefill(self, q, k, v, seq: PrefillSeq, k_cache, v_cache) -> torch.Tensor:
        n = q.shape[0]
        if q.dtype is torch.bfloat16 and q.device.type == "cpu" and BLOCKED_BF16_PREFILL:
            return self._prefill_blocked(q, k, v, seq, k_cache, v_cache)
        if seq.context_len == n:
            # Nothing cached before this chunk: attend over the fresh K/V, plain causal.
            keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
        elif _FLASH_WITH_LSE is not None and q.device.type == "cpu":
            return self._prefill_over_cache(q, k, v, seq, k_cache, v_cache)
        else:
            # Part of the prompt is already in the pool (earlier chunk or prefix-cache hit).
            keys, values = (_gather(cache, seq.block_table, 1, is_k)[:, 0, :seq.context_len]
                            for cache, is_k in ((k_cache, True), (v_cache, False)))
            query_pos = torch.arange(seq.context_len - n, seq.context_len).unsqueeze(1)
            mask = torch.arange(seq.context_len).unsqueeze(0) <= query_pos
            causal = False
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
            is_causal=causal, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return o.squeeze(0).transpose(0, 1)

    def _prefill_blocked(self, q, k, v, seq: PrefillSeq, k_cache, v_cache) -> torch.Tensor:
        """bf16 on CPU: attention in blocks of QUERY_BLOCK queries, each over the keys it may see (the
        cached prefix and the chunk up to its end), by two batched matmuls per block with the heads of
        a K/V group folded together, softmax in fp32. Torch's CPU flash kernel runs these shapes at a
        fraction of the machine's bf16 matmul rate; this costs 1.7-2.8x less (SmolLM2's shapes, one
        thread, Zen 5: 2,120 tokens 76 -> 39 ms a layer, 328 over 1,792 cached 23 -> 14 ms, 512 8.2 ->
        2.9 ms), at scores rounded to bf16 by the matmul (max error against fp32 0.012 vs flash's 0.008;
        fp32 keeps the flash paths, where this is no faster)."""
        n, group, D = q.shape[0], self.num_heads // self.num_kv_heads, self.head_dim
        cached = seq.context_len - n
        keys, values = k.transpose(0, 1), v.transpose(0, 1)                       # [kv_heads, n, D]
        if cached:
            old_keys, old_values = _cached_prefix(seq, cached, k_cache, v_cache)
            keys, values = torch.cat([old_keys, keys], 1), torch.cat([old_values, values], 1)
        queries = q.transpose(0, 1).reshape(self.num_kv_heads, group, n, D)      # head h reads K/V head h // group
        out = torch.empty_like(queries)
        for start in range(0, n, QUERY_BLOCK):
            end = min(n, start + QUERY_BLOCK)
            rows, context = end - start, cached + end
            scores = torch.bmm(queries[:, :, start:end].reshape(self.num_kv_heads, group * rows, D),
                               keys[:, :context].transpose(1, 2)).float().mul_(self.scale)
            scores = scores.view(self.num_kv_heads, group, rows, context)
            scores[..., cached + start:].masked_fill_(_later(rows), float("-inf"))     # causal within the chunk
            probs = torch.softmax(scores, -1).to(q.dtype).view(self.num_kv_heads, group * rows, context)
            out[:, :, start:end] = torch.bmm(probs, values[:, :context]).view(self.num_kv_heads, group, rows, D)
        return out.view(self.num_heads, n, D).transpose(0, 1)

    def _prefill_over_cache(self, q, k, v, seq: PrefillSeq, k_cache, v_cache) -> torch.Tensor:
        """A chunk after a cached prefix at the cost of its work: every query attends to the whole
        prefix (no mask) and causally to the chunk, two flash attentions whose outputs merge by their
        log-sum-exps. SmolLM2, 328 tokens after 1,792 cached, alternated with the dense masked path
        (AVX2 EPYC): 2,226 against 2,394 ms on one thread, 1,294 against 1,422 on two."""
        n = q.shape[0]
        cached = seq.context_len - n
        keys, values = (x.unsqueeze(0) for x in _cached_prefix(seq, cached, k_cache, v_cache))
        queries = q.transpose(0, 1).unsqueeze(0)                                    # [1, heads, n, D]
        over_prefix, lse_prefix = _FLASH_WITH_LSE(queries, keys, values, 0.0, False, scale=self.scale)[:2]
        over_chunk, lse_chunk = _FLASH_WITH_LSE(queries, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                                0.0, True, scale=self.scale)[:2]
        lse = torch.logaddexp(lse_prefix, lse_chunk)
        out = (over_prefix.float() * (lse_prefix - lse).exp().unsqueeze(-1)
               + over_chunk.float() * (lse_chunk - lse).exp().unsqueeze(-1))
        return out.to(q.dtype).squeeze(0).transpose(0, 1)

    def _decode(self, q, meta: BatchMetadata, k_cache, v_cache) -> torch.Tensor:
        """One query per sequence, in torch (the reference; kernels.paged_attention reads the blocks
        in place and serves fp32 on CPUs when it builds). _gather puts each sequence's K and V of each head into the batch
        that one bmm multiplies: one copy of the K/V per step, no transpose, and matmuls of
        [group, D] x [D, context] rather than thousands of per-block ones (measured: per-block bmm
        and advanced indexing cost ~3x more at 16 sequences). SDPA's flash kernel is ~10x slower at
        query length 1 on CPU."""
        B, group, D, kv_heads = q.shape[0], self.num_heads // self.num_kv_heads, self.head_dim, self.num_kv_heads
        keys, values = (_gather(cache, meta.decode_block_ids, B, is_k) for cache, is_k in ((k_cache, True), (v_cache, False)))
        S = keys.shape[2]                                                            # padded context per sequence
        q = q.view(B, kv_heads, group, D).transpose(0, 1).reshape(kv_heads * B, group, D)
        scores = torch.bmm(q, keys.view(kv_heads * B, S, D).transpose(1, 2)).float() * self.scale
        beyond = torch.arange(S, device=q.device) >= meta.decode_context_lens.unsqueeze(1)   # [B, S]: padding
        scores = scores.view(kv_heads, B, group, S).masked_fill_(beyond.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(kv_heads * B, group, S)
        out = torch.bmm(probs, values.view(kv_heads * B, S, D)).view(kv_heads, B, group, D)
        return out.transpose(0, 1).reshape(B, self.num_heads, D)


# Prompt rows through the decode kernels where the model allows it (LlamaModel.row_wise_prefill);
# a switch so that benchmarks can A/B it against torch's prefill (kvhandoff.bench.prefill_paths, and
# KVHANDOFF_ROW_WISE_PREFILL=0 for a whole stack's processes, e.g. under `kvhandoff bench --launch`).
ROW_WISE_PREFILL = os.environ.get("KVHANDOFF_ROW_WISE_PREFILL", "1") != "0"


def _as_decode_rows(meta: BatchMetadata) -> BatchMetadata:
    """The same batch with every prefill row as a decode row: its sequence's blocks, and a context
    that ends at its own token (the chunk's K/V is in the pool before any row attends)."""
    decode_rows = 0 if meta.decode_context_lens is None else meta.decode_context_lens.numel()
    width = max([seq.block_table.numel() for seq in meta.prefills]
                + [meta.decode_block_ids.numel() // decode_rows if decode_rows else 0])
    block_ids = torch.zeros(meta.num_prefill_tokens + decode_rows, width, dtype=torch.long)
    lens = []
    for seq in meta.prefills:
        n = seq.end - seq.start
        block_ids[seq.start:seq.end, :seq.block_table.numel()] = seq.block_table
        lens.append(torch.arange(seq.context_len - n + 1, seq.context_len + 1))
    if decode_rows:
        decode = meta.decode_block_ids.view(decode_rows, -1)
        block_ids[meta.num_prefill_tokens:, :decode.shape[1]] = decode
        lens.append(meta.decode_context_lens)
    return BatchMetadata(meta.slot_block, meta.slot_offset, decode_block_ids=block_ids.view(-1),
                         decode_context_lens=torch.cat(lens).long())


# bf16 prefill attention by blocks of queries (Attention._prefill_blocked): 64 and 128 measured fastest
# at SmolLM2's shapes, 256 slower than flash. A switch so that benchmarks can A/B the two paths.
QUERY_BLOCK = 64
BLOCKED_BF16_PREFILL = True


@functools.lru_cache(maxsize=8)
def _later(rows: int) -> torch.Tensor:
    """[rows, rows], True where the key comes after the query (masked)."""
    return torch.ones(rows, rows, dtype=torch.bool).triu_(1)


# Torch's CPU flash attention, which also returns each row's log-sum-exp (GQA included); private, so
# looked up: without it, a chunk over a cached prefix takes the dense masked path.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _cached_prefix(seq: PrefillSeq, cached: int, k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `cached` tokens of `seq` (already in the pool), each [kv_heads, cached, D]."""
    prefix = seq.block_table[:-(-cached // k_cache.shape[2])]
    return tuple(_gather(cache, prefix, 1, is_k)[:, 0, :cached] for cache, is_k in ((k_cache, True), (v_cache, False)))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, keys: bool) -> torch.Tensor:
    """One layer's K (`keys`) or V of `num_seqs` sequences, each `block_ids` run of equal length, as
    [kv_heads, num_seqs, blocks * block_size, head_dim]: per head one index_select, straight into
    place (a block's rows of one head are contiguous in the pool), no transpose; a bf16 pool's paired
    blocks then back in token order (paired_kv)."""
    _, kv_heads, block_size, head_dim = cache.shape
    out = torch.empty(kv_heads, num_seqs, block_ids.numel() // num_seqs * block_size, head_dim,
                      dtype=cache.dtype, device=cache.device)
    for head in range(kv_heads):
        torch.index_select(cache[:, head].flatten(1), 0, block_ids, out=out[head].view(-1, block_size * head_dim))
    return paired_kv.token_major(out.view(kv_heads, -1, block_size, head_dim), keys).view(out.shape)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.fused_norms = False    # norms and residual adds through kernels.rms_norm (use_cpu_kernels)

    def forward(self, x, rope, meta, kv_cache):
        if self.fused_norms:
            pre, post = self.input_layernorm, self.post_attention_layernorm
            attended = self.self_attn(kernels.rms_norm(x, pre.weight, pre.eps), rope, meta, kv_cache)
            normed = kernels.rms_norm(x, post.weight, post.eps, delta=attended)     # x += attended
            return x.add_(self.mlp(normed))
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


# Hugging Face parameter names that we pack into one matrix: (packed name, slot index).
_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.rotary = Rotary(cfg, max_positions or cfg.max_position_embeddings)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.packed_head: kernels.PackedLinear | None = None       # set by use_cpu_kernels
        self.vnni_head: torch.Tensor | None = None                  # (bf16, packed for bf16 dot products)
        self.fused_decode: kernels.FusedDecode | None = None        # every step's decode rows (use_cpu_kernels)
        self.row_wise_prefill = False       # prompt rows through fused_decode too (use_cpu_kernels)

    def use_cpu_kernels(self) -> None:
        """Serve through kernels.py. fp32: every linear layer's weight re-laid once for gemm_packed (the
        original dropped, so memory stays one copy; a tied embedding is looked up from the packed
        output matrix), decode attention reading the pool in place. bf16: the weights stay as they
        are (torch's paths read them), decode rows and their logits through the kernels, which read
        a copy packed for the CPU's bf16 dot products (kernels.pack_vnni), or else the same weights.
        Prompt rows too, as decode rows whose context ends at their own token (row_wise_prefill;
        in bf16 only where the CPU has bf16 dot products), so that every token is computed by one
        function: its logits and K/V do not depend on what shares its step, how its prompt was
        chunked, or a recompute after a preemption. Serving only: the HF state-dict methods need the
        plain layout."""
        dtype = next(self.parameters()).dtype
        assert kernels.available() and dtype in (torch.float32, torch.bfloat16)
        if dtype == torch.bfloat16:     # (the weights as they are, read in place)
            self.fused_decode = self._fused_decode()
            # Without bf16 dot products gemv_bf16 widens the weights for every 4 rows: far slower
            # than torch's bf16 matmuls at a prompt's row count.
            cfg = self.cfg
            self.row_wise_prefill = self.fused_decode is not None and all(kernels.native_bf16(width) for width in (
                cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size))
            if self.fused_decode is not None and kernels.native_bf16(cfg.hidden_size):
                head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
                self.vnni_head = kernels.pack_vnni_together([head.detach()])[0]
            return
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj, attn.o_proj = kernels.PackedLinear.of(attn.qkv_proj), kernels.PackedLinear.of(attn.o_proj)
            mlp.gate_up_proj, mlp.down_proj = kernels.PackedLinear.of(mlp.gate_up_proj), kernels.PackedLinear.of(mlp.down_proj)
            attn.paged_kernel = layer.fused_norms = True
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_head = kernels.PackedLinear(head.detach(), None)
        kernels.place_together([linear for layer in self.layers for linear in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            + [self.packed_head])
        self.fused_decode = self._fused_decode()
        self.row_wise_prefill = self.fused_decode is not None
        if self.lm_head is None:
            self.embed_tokens = None
        self.lm_head = None

    def batch_invariant(self, block_size: int) -> bool:
        """Is every token computed by one function (prompt rows as decode rows, through the kernels),
        so that its logits do not depend on what shares its step or how its prompt was chunked?"""
        return ROW_WISE_PREFILL and self.row_wise_prefill and kernels.attention_supported(
            self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim, block_size)

    def _fused_decode(self) -> kernels.FusedDecode | None:
        cfg = self.cfg
        if cfg.qk_norm:             # (q/k norms would need their own pass in decode_layer)
            return None
        return kernels.FusedDecode(
            [kernels.DecoderWeights(layer.input_layernorm.weight.detach(), layer.input_layernorm.eps,
                                    layer.post_attention_layernorm.weight.detach(),
                                    layer.post_attention_layernorm.eps, layer.self_attn.qkv_proj,
                                    layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
             for layer in self.layers], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5,
            (self.rotary.cos, self.rotary.sin), (self.norm.weight, self.norm.eps))

    def _decode_rows(self, input_ids: torch.Tensor, positions, meta: BatchMetadata, kv_cache, on_layer) -> torch.Tensor:
        """The decode rows (one token per sequence, after the prefill rows) through FusedDecode and
        the final norm, in fp32."""
        P = meta.num_prefill_tokens
        rest = (lambda rows: rows[P:]) if P else (lambda rows: rows)    # (no slice, a torch op, when all decode)
        ids = rest(input_ids)
        if self.embed_tokens is None:
            x = self.packed_head.rows(ids)
        else:
            x = kernels.embed_rows(self.embed_tokens.weight, ids)
        return self.fused_decode(x, rest(positions), rest(meta.slot_block), rest(meta.slot_offset),
                                 meta.decode_block_ids, meta.decode_context_lens, kv_cache, on_layer)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) if self.embed_tokens is not None else self.packed_head.rows(input_ids)

    def forward(self, input_ids, positions, meta: BatchMetadata, kv_cache, on_layer=None) -> torch.Tensor:
        """`on_layer(i)`, if given, runs once layer i's K/V for this batch are in the pool (layer-wise
        handoff sends them while later layers compute). Returns the final norm's output (fp32 where
        any row went through the kernels)."""
        P, T = meta.num_prefill_tokens, input_ids.shape[0]
        if P and self.batch_invariant(kv_cache.shape[4]):
            # Prompt rows as decode rows: every token computed by one function (batch-invariant).
            return self._decode_rows(input_ids, positions, _as_decode_rows(meta), kv_cache, on_layer)
        if self.fused_decode is not None and T > P and \
                kernels.attention_supported(self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim, kv_cache.shape[4]):
            # Decode rows always through the kernels, apart from any prefill rows beside them: a
            # sequence's token is then computed the same way whatever shares its step (batch-invariant).
            decode = self._decode_rows(input_ids, positions, meta, kv_cache, None if P else on_layer)
            if not P:
                return decode
            prefill_meta = BatchMetadata(meta.slot_block[:P], meta.slot_offset[:P], meta.prefills, P)
            prefill = self._layers(self.embed(input_ids[:P]), positions[:P], prefill_meta, kv_cache, on_layer)
            return torch.cat([prefill.to(decode.dtype), decode])
        return self._layers(self.embed(input_ids), positions, meta, kv_cache, on_layer)

    def _layers(self, x, positions, meta: BatchMetadata, kv_cache, on_layer) -> torch.Tensor:
        """Every row through the layers, op by op (torch, or the fp32 kernels' PackedLinear)."""
        rope = self.rotary.table(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, meta, kv_cache)
            if on_layer is not None:
                on_layer(i)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return self.packed_head(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.fused_decode is not None and weight.dtype == torch.bfloat16:
            return kernels.linear_bf16(hidden, weight.detach(), self.vnni_head)   # (fp32 rows; the decode rows' way)
        return F.linear(hidden, weight).float()

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in Hugging Face Llama/Qwen checkpoints, packing q/k/v and gate/up."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in tensors.items():
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue        # tied: the embedding serves as the head
            parts = name.split(".")
            proj = parts[-2] if len(parts) >= 2 else ""
            if proj in _PACKED:
                packed, index = _PACKED[proj]
                target = ".".join(parts[:-2] + [packed, parts[-1]])
                param = params[target]
                sizes = self._packed_sizes(packed)
                offset = sum(sizes[:index])
                param.data[offset:offset + sizes[index]].copy_(tensor)
                seen.add(f"{target}#{index}")
            else:
                if name not in params:
                    raise KeyError(f"unexpected weight {name!r} in checkpoint")
                params[name].data.copy_(tensor)
                seen.add(name)
        missing = [n for n in params if n not in seen and not any(s.startswith(n + "#") for s in seen)]
        if missing:
            raise KeyError(f"checkpoint lacks weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")

    def _packed_sizes(self, packed: str) -> list[int]:
        cfg = self.cfg
        if packed == "qkv_proj":
            return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        return [cfg.intermediate_size, cfg.intermediate_size]


@torch.inference_mode()
def prompt_logits(model: LlamaModel, token_ids: list[int], block_size: int = 32) -> torch.Tensor:
    """Logits [T, vocab] for every position of one prompt, through the paged path in one prefill.

    For parity tests and tools; serving goes through the engine's runner.
    """
    cfg, param = model.cfg, next(model.parameters())
    T = len(token_ids)
    num_blocks = (T + block_size - 1) // block_size
    kv_cache = torch.zeros(cfg.num_layers, num_blocks, 2, cfg.num_kv_heads, block_size, cfg.head_dim,
                           dtype=param.dtype, device=param.device)
    slots = torch.arange(T, device=param.device)
    meta = BatchMetadata(slot_block=slots // block_size, slot_offset=slots % block_size,
                         prefills=[PrefillSeq(0, T, T, torch.arange(num_blocks, device=param.device))],
                         num_prefill_tokens=T)
    ids = torch.tensor(token_ids, device=param.device)
    return model.logits(model(ids, slots, meta, kv_cache))
