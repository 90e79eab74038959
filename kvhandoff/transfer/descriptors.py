"""Descriptor lists: which bytes of which registered regions a transfer touches, and the plan that
turns a (local, remote) pair of lists into the few contiguous segments that actually move.

Descriptors are kept in column form (numpy arrays), because a fragmented KV handoff can name tens of
thousands of blocks: splitting, coalescing and bounds checks are then a handful of vectorised
operations instead of a Python loop per descriptor.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from kvhandoff.transfer.errors import OutOfBoundsError


@dataclass(frozen=True)
class DescList:
    """Descriptors (region, offset, length) in column form; region names are interned in `names`."""
    names: tuple[str, ...]
    region: np.ndarray          # int64 index into names, one per descriptor
    offset: np.ndarray          # int64 bytes from the region's start
    length: np.ndarray          # int64 bytes, > 0

    @classmethod
    def of(cls, descs: DescList | Iterable[tuple[str, int, int]]) -> DescList:
        if isinstance(descs, DescList):
            return descs
        rows = list(descs)
        if not rows:
            raise ValueError("empty descriptor list")
        index: dict[str, int] = {}
        region = [index.setdefault(r, len(index)) for r, _, _ in rows]
        try:
            offset = np.array([o for _, o, _ in rows], dtype=np.int64)
            length = np.array([n for _, _, n in rows], dtype=np.int64)
        except OverflowError as e:
            raise OutOfBoundsError(f"descriptor offset or length out of range: {e}") from None
        return cls(tuple(index), np.array(region, dtype=np.int64), offset, length)

    @classmethod
    def blocks(cls, region: str, block_ids: Iterable[int], block_bytes: int, base: int = 0) -> DescList:
        """One descriptor per block of a paged pool: block i is bytes [base + i*block_bytes, +block_bytes)."""
        ids = np.fromiter(block_ids, dtype=np.int64)
        if ids.size == 0:
            raise ValueError("empty descriptor list")
        return cls((region,), np.zeros(ids.size, np.int64), base + ids * block_bytes,
                   np.full(ids.size, block_bytes, np.int64))

    def __len__(self) -> int:
        return int(self.offset.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def check_bounds(self, sizes: Mapping[str, int], whose: str) -> None:
        """Raise OutOfBoundsError unless every descriptor lies inside its region (`sizes`: name -> bytes)."""
        missing = [n for n in self.names if n not in sizes]
        if missing:
            raise OutOfBoundsError(f"{whose} region {missing[0]!r} is not registered")
        if len(self) == 1:                      # a single op should not pay numpy's fixed costs
            offset, length, size = int(self.offset[0]), int(self.length[0]), sizes[self.names[0]]
            bad = [] if length > 0 and 0 <= offset and offset + length <= size else [0]
        else:
            size = np.array([sizes[n] for n in self.names], dtype=np.int64)[self.region]
            # No term can overflow int64: size - length is only compared once length <= size.
            bad = np.flatnonzero((self.length <= 0) | (self.offset < 0) | (self.length > size)
                                 | (self.offset > size - self.length))
        if len(bad):
            i = int(bad[0])
            name = self.names[self.region[i]]
            raise OutOfBoundsError(
                f"{whose} descriptor {i} (region {name!r}, offset {int(self.offset[i])}, length "
                f"{int(self.length[i])}) is outside the region's {sizes[name]} bytes")


@dataclass(frozen=True)
class Plan:
    """Segments that are contiguous on both sides; `len(plan)` is the descriptor count on the wire."""
    local: DescList
    remote: DescList

    def __len__(self) -> int:
        return len(self.local)

    @property
    def nbytes(self) -> int:
        return self.local.nbytes


def plan(local: DescList, remote: DescList) -> Plan:
    """Pair two descriptor lists of equal total length and coalesce what is adjacent on both sides.

    The lists may cut the bytes differently (one 1 MiB local descriptor against sixteen 64 KiB remote
    blocks): both are first split at the union of their boundaries, so every segment lies inside one
    local and one remote descriptor, then neighbours that continue each other on both sides merge.
    """
    if len(local) == len(remote) == 1 and local.length[0] == remote.length[0] > 0:
        return Plan(local, remote)              # one 4 KiB op should not pay for the general case
    if local.nbytes != remote.nbytes:
        raise ValueError(f"local descriptors cover {local.nbytes} bytes, remote ones {remote.nbytes}")
    if (local.length <= 0).any() or (remote.length <= 0).any():
        raise OutOfBoundsError("descriptor lengths must be positive")
    if len(local) == len(remote) and np.array_equal(local.length, remote.length):
        lengths = local.length                  # the common case: both sides cut the bytes alike
        l_region, l_offset, r_region, r_offset = local.region, local.offset, remote.region, remote.offset
    else:
        local_ends, remote_ends = np.cumsum(local.length), np.cumsum(remote.length)
        ends = np.union1d(local_ends, remote_ends)
        starts = np.concatenate(([0], ends[:-1]))
        lengths = ends - starts
        l_region, l_offset = _locate(local, local_ends, starts)
        r_region, r_offset = _locate(remote, remote_ends, starts)
    continues = ((l_region[1:] == l_region[:-1]) & (l_offset[1:] == l_offset[:-1] + lengths[:-1])
                 & (r_region[1:] == r_region[:-1]) & (r_offset[1:] == r_offset[:-1] + lengths[:-1]))
    heads = np.flatnonzero(np.concatenate(([True], ~continues)))
    merged = np.add.reduceat(lengths, heads)
    assert merged.sum() == local.nbytes
    return Plan(DescList(local.names, l_region[heads], l_offset[heads], merged),
                DescList(remote.names, r_region[heads], r_offset[heads], merged.copy()))


def _locate(descs: DescList, ends: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Region and offset of each global byte position in `starts` within a descriptor list."""
    i = np.searchsorted(ends, starts, side="right")
    return descs.region[i], descs.offset[i] + (starts - (ends[i] - descs.length[i]))
