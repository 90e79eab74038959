"""The KV block pool: block ids, reference counts and the prefix cache (a hash chain over full blocks).

Only ids and bookkeeping live here; the KV tensor itself belongs to the runner. A block whose
reference count drops to zero returns to the free list but keeps its hash, so a later prompt with
the same prefix can revive it until the block is handed out again. Free means reusable: the free
count includes such cached blocks.

With `events` a list (a worker that publishes what it holds: worker/kv_events.py), every block
entering the cache appends `(STORED, hash, parent hash, token ids)` and every cached block handed out
again `(REMOVED, hash)`; the engine loop takes them after each step.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass


def block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Hash of a full block, chained to its parent so equal blocks at different prefixes differ."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def hash_chain(token_ids: list[int], block_size: int) -> list[bytes]:
    """Hashes of every full block of `token_ids`."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


STORED, REMOVED = "stored", "removed"


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None           # set once the block is full and its K/V computed
    parent: bytes | None = None         # the hash of the block before it in its chain (kept for the events)
    token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Ordered so that handing out the oldest-freed block first keeps recently cached prefixes
        # alive longest (LRU eviction of cached blocks).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.hits = self.queries = 0
        self.events: list[tuple] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (evicting cached content), or raise MemoryError taking none."""
        if count > len(self.free):
            raise MemoryError(f"need {count} KV blocks, {len(self.free)} free")
        ids = []
        for _ in range(count):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                del self.cached[block.hash]
                if self.events is not None:
                    self.events.append((REMOVED, block.hash))
                block.hash = None
            block.ref_count = 1
            ids.append(block_id)
        # The same blocks (the least recently freed), in ascending order: blocks freed together (a
        # finished sequence's, released tail first) come back as runs of adjacent blocks, which a
        # layer-major pool lays side by side for decode attention to read as one stream.
        ids.sort()
        return ids

    def free_blocks(self, block_ids: list[int]) -> None:
        # Release in reverse so a sequence's tail blocks are evicted before its head (heads are the
        # prefixes most likely to be shared).
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Take a reference on the longest run of cached blocks matching `hashes`; return their ids."""
        if not self.enable_prefix_caching:
            return []
        ids = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            ids.append(block_id)
        self.queries += len(hashes)
        self.hits += len(ids)
        return ids

    def cached_prefix_len(self, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` the cache holds now (a peek: no references taken)."""
        n = 0
        if self.enable_prefix_caching:
            while n < len(hashes) and hashes[n] in self.cached:
                n += 1
        return n

    def register(self, block_id: int, h: bytes, parent: bytes | None, token_ids: list[int]) -> None:
        """Publish a full, computed block under its chain hash (first writer wins)."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.hash is None and h not in self.cached:
            block.hash, block.parent = h, parent
            self.cached[h] = block_id
            if self.events is not None:
                block.token_ids = tuple(token_ids)
                self.events.append((STORED, h, parent, block.token_ids))

    def take_events(self) -> list[tuple]:
        events, self.events = self.events, []
        return events

    def snapshot(self) -> list[tuple]:
        """Every cached block as a STORED event, in the order they entered the cache (parents first)."""
        return [(STORED, h, self.blocks[i].parent, self.blocks[i].token_ids) for h, i in self.cached.items()]
