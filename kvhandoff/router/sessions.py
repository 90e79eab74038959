"""The router's session map (bidirectional reuse): where each conversation's retained KV lives.

An entry is what a decode worker reported when it kept a finished turn: {decode worker, retention id,
token count, hash chain of the retained tokens, expiry}. Conversations are named by the client
(`X-Session-Id` header or `session_id` field) or, for clients that send nothing special, found by the
longest match between the new prompt's block hashes and the retained chains. The map only points:
the prefill worker re-checks the prefix before it reads anything, so a stale entry costs a recompute,
never a wrong token.

The map is filled from two sides: what this router's own turns reported (remember), and the decode
workers' KV events (kv_index.py: a turn kept, kept again, let go; a worker cleared), which every
router reads, so that with more than one router (`--shared-sessions`) each knows the turns the others
served without asking. The decode workers stay the one place a conversation's whereabouts live: a
router that starts late or restarts reads them back from the events' replay. A decode worker whose
events are not fresh (kv_feed.py) is asked on the turn's path instead (`/kv/retained/find`), for the
session's newest entry or the longest prefix match.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from kvhandoff.router.answer import UpstreamError
from kvhandoff.wire import kv_events as E
from kvhandoff.wire import messages as M
from kvhandoff.wire.cost import common_prefix_blocks
from kvhandoff.wire.modes import Role


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
    kept_at: float = field(default_factory=time.time)       # when the worker kept it (wall clock: events' ts)

    def candidate(self) -> M.ReuseCandidate:
        """What the prefill worker is told (kv_transfer_params.reuse)."""
        return M.ReuseCandidate(decode_url=self.decode_url, retention_id=self.retention_id, num_tokens=self.num_tokens,
                                block_hashes=self.block_hashes, expires_in_s=round(self.expiry - time.monotonic(), 3))


class SessionMap:
    def __init__(self, max_entries: int = 10_000):
        self.max_entries = max_entries
        self.entries: OrderedDict[str, SessionEntry] = OrderedDict()      # least recently used first
        self.by_first_block: dict[str, set[str]] = {}                     # first block hash -> keys
        self.by_retention: dict[str, str] = {}                            # retention id -> key

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
            n = common_prefix_blocks(prompt_hashes, entry.block_hashes)
            if n > best_len:
                best, best_len = entry, n
        return best

    def record(self, entry: SessionEntry) -> None:
        self.drop(entry.key)
        self.entries[entry.key] = entry
        self.by_retention[entry.retention_id] = entry.key
        if entry.block_hashes:
            self.by_first_block.setdefault(entry.block_hashes[0], set()).add(entry.key)
        while len(self.entries) > self.max_entries:
            self.drop(next(iter(self.entries)))

    def drop(self, key: str) -> SessionEntry | None:
        entry = self.entries.pop(key, None)
        if entry is not None and self.by_retention.get(entry.retention_id) == key:
            del self.by_retention[entry.retention_id]
        if entry is not None and entry.block_hashes:
            keys = self.by_first_block.get(entry.block_hashes[0])
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.by_first_block[entry.block_hashes[0]]
        return entry

    def drop_retained(self, retention_id: str) -> SessionEntry | None:
        """Drop the entry of this retained turn, unless its conversation has moved on to another."""
        key = self.by_retention.get(retention_id)
        entry = self.entries.get(key) if key is not None else None
        return self.drop(key) if entry is not None and entry.retention_id == retention_id else None

    def sweep(self) -> list[SessionEntry]:
        """Drop and return the expired entries."""
        now = time.monotonic()
        return [self.drop(key) for key, entry in list(self.entries.items()) if entry.expiry <= now]


DEFAULT_TTL_S = 480.0           # a worker's retention ttl when its events do not say (worker/config.py's default)
GONE_REMEMBERED = 4096          # retention ids let go that the router keeps in mind (Sessions.gone)

# A decode worker that does not answer a lookup in this long is skipped (its turns are recomputed):
# the lookup is on every bidirectional turn's critical path.
FIND_TIMEOUT_S = 2.0


class Sessions:
    """The router's side of bidirectional reuse: find a request's history, remember where a turn's
    KV was kept, and tell a worker whose entry moved elsewhere that it can free it."""

    def __init__(self, router):
        self.router = router
        self.map = SessionMap()
        self.last_sweep = 0.0
        self.gone: OrderedDict[str, None] = OrderedDict()      # retention ids whose removal events came

    async def find(self, attempt) -> SessionEntry | None:
        """Where this conversation's history is kept: by the client's session id, else by the longest
        block-hash match of the prompt (its hashes made by the router, or by a prefill worker)."""
        now = time.monotonic()
        if now - self.last_sweep > 1.0:
            self.last_sweep = now
            for entry in self.map.sweep():
                log.debug("session %s: retained KV expired", entry.key)
        # With one router its map knows every turn; with several, the events tell it the others' turns,
        # and only the decode workers whose events are not fresh are asked (another router may have
        # left a newer turn there: the newer of the two wins).
        fresh = self.router.feeds.fresh_urls()
        stale = [w for w in self.router.pool.serving(Role.DECODE) if w.url not in fresh] \
            if self.router.config.shared_sessions else []
        if attempt.session_id is not None:
            known = self.map.get(attempt.session_id)
            return self.newer(known, await self.ask_workers(stale, attempt.session_id, []) if stale else None)
        if not stale and not len(self.map):
            return None
        if await self.router.prompt_facts(attempt) is None:
            log.warning("handoff %s: no prompt hashes from a prefill worker: no reuse", attempt.handoff_id)
            return None
        hashes = attempt.facts.block_hashes
        known = self.map.match(hashes)
        return self.newer(known, await self.ask_workers(stale, None, hashes) if stale and hashes else None)

    def newer(self, known: SessionEntry | None, asked: SessionEntry | None) -> SessionEntry | None:
        """Of what the map knew and what a worker without events answered, the later kept (recorded)."""
        if asked is None or (known is not None and known.kept_at >= asked.kept_at):
            return known
        self.map.record(asked)
        return asked

    def event_retained(self, url: str, event: E.BlockStored, ttl_s: float | None, kept_at: float) -> None:
        """A decode worker's event (published at `kept_at`, wall clock): it keeps, or kept again, a turn."""
        retention_id = event.ownership or ""
        key = event.session_id or f"anon:{retention_id}"
        current = self.map.entries.get(key)
        if current is not None and current.retention_id != retention_id and current.kept_at > kept_at:
            log.debug("session %s: %s on %s is older than %s: not recorded", key, retention_id, url,
                      current.retention_id)
            return          # an older turn's event, read after the newer turn's (from another worker's feed)
        hashes = [h.hex() if isinstance(h, bytes) else str(h) for h in event.block_hashes]
        self.map.record(SessionEntry(key, url, retention_id, len(event.token_ids), hashes,
                                     time.monotonic() + (ttl_s if ttl_s is not None else DEFAULT_TTL_S),
                                     kept_at=kept_at))

    def event_unretained(self, url: str, event: E.BlockRemoved) -> None:
        """A decode worker's event: a kept turn expired, was evicted or superseded. Remembered a while,
        since the decode answer that reports the turn kept can come after (a turn evicted at once)."""
        if event.ownership:
            self.map.drop_retained(event.ownership)
            self.gone[event.ownership] = None
            while len(self.gone) > GONE_REMEMBERED:
                self.gone.popitem(last=False)

    def worker_cleared(self, url: str) -> None:
        """A decode worker restarted or left (or sends a snapshot): none of its turns is kept any more."""
        for key in [k for k, entry in self.map.entries.items() if entry.decode_url == url]:
            self.map.drop(key)

    async def ask_workers(self, workers: list, session_id: str | None, hashes: list[str]) -> SessionEntry | None:
        """These decode workers at once: the conversation's newest retained turn (by session id), else
        the one sharing the most leading blocks with the prompt (find() records it in the map if it is
        the newer, so that remember() frees it once the turn it serves is kept elsewhere)."""
        query = M.RetainedQuery(session=session_id, block_hashes=hashes)
        self.router.metrics.asked.labels("/kv/retained/find").inc(len(workers))

        async def ask(worker) -> tuple[str, M.Retained, int] | None:
            try:
                status, data = await self.router.upstream.call("POST", worker.url + "/kv/retained/find", query,
                                                               timeout=FIND_TIMEOUT_S)
                found = data.get("retained") if status == 200 and isinstance(data, dict) else None
                if not isinstance(found, dict):
                    return None
                matched = int(found.pop("matched_blocks", 0))
                return worker.url, M.parse(M.Retained, found, "/kv/retained/find answer"), matched
            except (UpstreamError, M.MessageError, ValueError, TypeError) as e:
                log.info("session lookup on %s failed (%s): that worker's turns are recomputed", worker.url, e)
                return None
        answers = [a for a in await asyncio.gather(*(ask(w) for w in workers)) if a]
        if not answers:
            return None
        url, retained, _ = max(answers, key=lambda a: (a[2], a[1].expires_in_s))
        key = session_id or f"anon:{retained.retention_id}"
        ttl = self.ttl_of(url)      # (kept at: as long before now as its ttl is longer than what is left)
        kept_at = time.time() - (ttl - retained.expires_in_s if ttl is not None else 0.0)
        return SessionEntry(key, url, retained.retention_id, retained.num_tokens, list(retained.block_hashes),
                            time.monotonic() + retained.expires_in_s, retained.bytes, kept_at=kept_at)

    def ttl_of(self, url: str) -> float | None:
        """A decode worker's retention ttl, as its /health says (its KV events' description)."""
        worker = self.router.pool.find(url)
        about = worker.last_health.get("kv_events") if worker is not None else None
        ttl = about.get("retention_ttl_s") if isinstance(about, dict) else None
        return float(ttl) if isinstance(ttl, (int, float)) else None

    def remember(self, attempt, retained: M.Retained | None) -> M.Retained | None:
        """Record where this turn's KV is kept now; forget (and free) the turn it replaces. Returns
        what the client's handoff object shows of it."""
        old = attempt.candidate
        if retained is None:
            return None                  # not kept (an error, or the worker has no retention): keep the old one
        key = attempt.session_id or f"anon:{retained.retention_id}"
        if old is not None:
            # (By retention id: the entry under its key may be a newer turn already, this one's own
            # event, or another conversation's whose history this prompt matched.)
            self.map.drop_retained(old.retention_id)
            if old.decode_url != attempt.decode.url:     # superseded on another worker: it can free it now
                holder = self.router.pool.find(old.decode_url)
                if holder is not None:
                    self.router.tell(holder, "/kv/retained/release", M.RetainedRef(retention_id=old.retention_id))
        if retained.retention_id not in self.gone:     # (its worker let it go already: its event came first)
            self.map.record(SessionEntry(key, attempt.decode.url, retained.retention_id, retained.num_tokens,
                                         list(retained.block_hashes), time.monotonic() + retained.expires_in_s,
                                         retained.bytes))
        # The client sees where its history is kept, not the hash chain (protocol payload).
        return msgspec.structs.replace(retained, block_hashes=[], session=key)
