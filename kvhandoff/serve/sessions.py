"""The router's session map (bidirectional reuse): where each conversation's retained KV lives.

An entry is what a decode worker reported when it kept a finished turn: {decode worker, retention id,
token count, hash chain of the retained tokens, expiry}. Conversations are named by the client
(`X-Session-Id` header or `session_id` field) or, for clients that send nothing special, found by the
longest match between the new prompt's block hashes and the retained chains. The map only points:
the prefill worker re-checks the prefix before it reads anything, so a stale entry costs a recompute,
never a wrong token.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class SessionEntry:
    key: str                    # the client's session id, or "anon:<retention id>"
    decode_url: str
    retention_id: str
    num_tokens: int
    block_hashes: list[str]
    expiry: float               # time.monotonic()
    nbytes: int = 0
    last_used: float = field(default_factory=time.monotonic)

    def candidate(self) -> dict:
        """What the prefill worker is told (kv_transfer_params.reuse)."""
        return {"decode_url": self.decode_url, "retention_id": self.retention_id, "num_tokens": self.num_tokens,
                "block_hashes": self.block_hashes, "expires_in_s": round(self.expiry - time.monotonic(), 3)}


class SessionMap:
    def __init__(self, max_entries: int = 10_000):
        self.max_entries = max_entries
        self.entries: OrderedDict[str, SessionEntry] = OrderedDict()      # least recently used first
        self.by_first_block: dict[str, set[str]] = {}                     # first block hash -> keys

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> SessionEntry | None:
        entry = self.entries.get(key)
        if entry is not None and entry.expiry <= time.monotonic():
            self.drop(key)
            return None
        return entry

    def match(self, prompt_hashes: list[str]) -> SessionEntry | None:
        """The live entry sharing the most leading blocks with the prompt (None if none shares one)."""
        best, best_len = None, 0
        for key in list(self.by_first_block.get(prompt_hashes[0], ())) if prompt_hashes else ():
            entry = self.get(key)
            if entry is None:
                continue
            n = 0
            for ours, theirs in zip(prompt_hashes, entry.block_hashes):
                if ours != theirs:
                    break
                n += 1
            if n > best_len:
                best, best_len = entry, n
        return best

    def record(self, entry: SessionEntry) -> None:
        self.drop(entry.key)
        self.entries[entry.key] = entry
        if entry.block_hashes:
            self.by_first_block.setdefault(entry.block_hashes[0], set()).add(entry.key)
        while len(self.entries) > self.max_entries:
            self.drop(next(iter(self.entries)))

    def drop(self, key: str) -> SessionEntry | None:
        entry = self.entries.pop(key, None)
        if entry is not None and entry.block_hashes:
            keys = self.by_first_block.get(entry.block_hashes[0])
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.by_first_block[entry.block_hashes[0]]
        return entry

    def sweep(self) -> list[SessionEntry]:
        """Drop and return the expired entries."""
        now = time.monotonic()
        return [self.drop(key) for key, entry in list(self.entries.items()) if entry.expiry <= now]
