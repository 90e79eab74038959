"""Where a token's K and V sit inside a KV block, for torch's paths.

A bf16 pool keeps each head's K and V of a block in the "paired" layouts that cpu_kernels.c's
attention reads (issue 25): K as [head_dim / 2][block_size][2] (dimensions 2p and 2p + 1 of
consecutive tokens side by side) and V as [block_size / 2][head_dim][2] (tokens 2i and 2i + 1 of each
dimension side by side), the pairs one bf16 dot product takes, so that its products need no sums
across lanes. Every other dtype is token-major ([block_size][head_dim]). The layout is fixed by the
dtype alone, whatever the CPU: a block's bytes mean the same on every worker of one dtype, so
transfers, retention and prefix caching move blocks as opaque bytes, as before.

Each layer's K (V) view of the pool keeps its shape [blocks, kv_heads, block_size, head_dim]; these
functions store a step's tokens into it and turn gathered blocks back into token-major order.
"""
from __future__ import annotations

import torch


def paired(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16


class OddBlockSize(ValueError):
    """A bf16 pool asked for with an odd block size (cli.py turns it into one line)."""


def check_block_size(dtype: torch.dtype, block_size: int) -> None:
    if paired(dtype) and block_size % 2:
        raise OddBlockSize(f"a bf16 KV pool keeps tokens in pairs: the block size (--block-size) must be even, not {block_size}")


def _pair_view(cache: torch.Tensor, keys: bool) -> torch.Tensor:
    """cache [blocks, kv_heads, bs, D] (a layer's view of the pool) seen as K's [.., D/2, bs, 2] or V's
    [.., bs/2, D, 2]: the same bytes, strided as they are laid out."""
    blocks, kv_heads, bs, D = cache.shape
    block_stride, head_stride = cache.stride(0), cache.stride(1)
    assert cache.stride()[2:] == (D, 1) and head_stride == bs * D
    size = (blocks, kv_heads, D // 2, bs, 2) if keys else (blocks, kv_heads, bs // 2, D, 2)
    stride = (block_stride, head_stride, 2 * bs, 2, 1) if keys else (block_stride, head_stride, 2 * D, 2, 1)
    return cache.as_strided(size, stride, cache.storage_offset())


def store(cache: torch.Tensor, slot_block: torch.Tensor, slot_offset: torch.Tensor, x: torch.Tensor,
          keys: bool) -> None:
    """x [T, kv_heads, D] (K if `keys`, else V) into a layer's view at (slot_block, slot_offset)."""
    if not paired(cache.dtype):
        cache[slot_block, :, slot_offset] = x
    elif keys:
        T, kv_heads, D = x.shape
        _pair_view(cache, True)[slot_block, :, :, slot_offset] = x.reshape(T, kv_heads, D // 2, 2)
    else:
        _pair_view(cache, False)[slot_block, :, slot_offset // 2, :, slot_offset % 2] = x


def token_major(runs: torch.Tensor, keys: bool) -> torch.Tensor:
    """Block runs [..., bs, D] as they lie in the pool -> [..., bs, D] token-major (a copy if paired)."""
    if not paired(runs.dtype):
        return runs
    *lead, bs, D = runs.shape
    if keys:
        return runs.reshape(*lead, D // 2, bs, 2).transpose(-3, -2).reshape(*lead, bs, D)
    return runs.reshape(*lead, bs // 2, D, 2).transpose(-2, -1).reshape(*lead, bs, D)


def as_stored(blocks: torch.Tensor, keys: bool) -> torch.Tensor:
    """token_major's inverse: token-major blocks [..., bs, D] laid out as the pool keeps them."""
    if not paired(blocks.dtype):
        return blocks
    *lead, bs, D = blocks.shape
    if keys:
        return blocks.reshape(*lead, bs, D // 2, 2).transpose(-3, -2).reshape(*lead, bs, D)
    return blocks.reshape(*lead, bs // 2, 2, D).transpose(-2, -1).reshape(*lead, bs, D)
