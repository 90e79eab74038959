"""The router's session map (bidirectional reuse): where each conversation's retained KV lives.

An entry is what a decode worker reported when it kept a finished turn: {decode worker, retention id,
token count, hash chain of the retained tokens, expiry}. Conversations are named by the client
(`X-Session-Id` header or `session_id` field) or, for clients that send nothing special, found by the
longest match between the new prompt's block hashes and the retained chains. The map only points:
the prefill worker re-checks the prefix before it reads anything, so a stale entry costs a recompute,
never a wrong token.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvhandoff.router.prefix import prompt_facts
from kvhandoff.wire import messages as M


log = logging.getLogger("kvhandoff.router")


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


class Sessions:
    """The router's side of bidirectional reuse: find a request's history, remember where a turn's
    KV was kept, and tell a worker whose entry moved elsewhere that it can free it."""

    def __init__(self, router):
        self.router = router
        self.map = SessionMap()
        self.last_sweep = 0.0

    async def find(self, attempt) -> SessionEntry | None:
        """Where this conversation's history is kept: by the client's session id, else by the longest
        block-hash match of the prompt (its hashes come from a prefill worker, which tokenizes)."""
        now = time.monotonic()
        if now - self.last_sweep > 1.0:
            self.last_sweep = now
            for entry in self.map.sweep():
                log.debug("session %s: retained KV expired", entry.key)
        if attempt.session_id is not None:
            return self.map.get(attempt.session_id)
        if not len(self.map):
            return None
        if attempt.facts is None:            # fetched once per request: the policies read them too
            attempt.facts = await prompt_facts(self.router, attempt)
        if attempt.facts is None:
            log.warning("handoff %s: no prompt hashes from a prefill worker: no reuse", attempt.handoff_id)
            return None
        return self.map.match(attempt.facts.block_hashes)

    def remember(self, attempt, retained: M.Retained | None) -> dict | None:
        """Record where this turn's KV is kept now; forget (and free) the turn it replaces. Returns
        what the client's handoff object shows of it."""
        old = attempt.candidate
        if retained is None:
            return None                  # not kept (an error, or the worker has no retention): keep the old one
        key = attempt.session_id or f"anon:{retained.retention_id}"
        if old is not None:
            self.map.drop(old.key)
            if old.decode_url != attempt.decode.url:     # superseded on another worker: it can free it now
                holder = self.router.pool.find(old.decode_url)
                if holder is not None:
                    self.router.tell(holder, "/kv/retained/release", {"retention_id": old.retention_id})
        self.map.record(SessionEntry(key, attempt.decode.url, retained.retention_id, retained.num_tokens,
                                     list(retained.block_hashes), time.monotonic() + retained.expires_in_s,
                                     retained.bytes))
        # The client sees where its history is kept, not the hash chain (protocol payload).
        return {k: v for k, v in retained.to_dict().items() if k != "block_hashes"} | {"session": key}
