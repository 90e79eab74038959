"""Where a KV block's bytes sit in a worker's registered region, and the checksums that prove a
copy of them arrived whole.

The engine's pool is block-major ([blocks, layers, K/V, kv_heads, block_size, head_dim]), so a block
is one contiguous range and one layer of one block is a contiguous sub-range. Descriptor lists are
built per block (or per block and layer); the transfer layer coalesces runs of adjacent blocks.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # the router imports the handoff modules for their router legs: no torch there
    import torch

REGION = "kv"


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    block_bytes: int
    num_layers: int

    @property
    def layer_bytes(self) -> int:
        return self.block_bytes // self.num_layers

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> "KVLayout":
        num_blocks, num_layers = kv_cache.shape[:2]
        return cls(num_blocks, kv_cache[0].numel() * kv_cache.element_size(), num_layers)

    def block_descs(self, block_ids: list[int]) -> list[tuple[str, int, int]]:
        self._check(block_ids)
        return [(REGION, b * self.block_bytes, self.block_bytes) for b in block_ids]

    def layer_descs(self, block_ids: list[int], first_layer: int, num_layers: int = 1) -> list[tuple[str, int, int]]:
        """Layers [first_layer, first_layer + num_layers) of each block: one contiguous range per block."""
        self._check(block_ids)
        assert 0 <= first_layer and num_layers > 0 and first_layer + num_layers <= self.num_layers
        return [(REGION, b * self.block_bytes + first_layer * self.layer_bytes, num_layers * self.layer_bytes)
                for b in block_ids]

    def _check(self, block_ids: list[int]) -> None:
        assert all(0 <= b < self.num_blocks for b in block_ids), f"block id out of range: {block_ids}"


def block_checksums(kv_cache: torch.Tensor, block_ids: list[int]) -> list[int]:
    """CRC-32 of each block's bytes (every layer, K and V, including unused slots of a partial block:
    those travel too, so both sides agree on them). ~1.7 GB/s here, a few ms per handoff."""
    import torch        # loaded already wherever there is a pool (see the TYPE_CHECKING import)
    flat = kv_cache.view(kv_cache.shape[0], -1)
    return [zlib.crc32(flat[b].view(torch.uint8).cpu().numpy()) for b in block_ids]
