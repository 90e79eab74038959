"""Bidirectional reuse on vLLM workers: where each conversation's KV is kept (router/vllm.py's attempts
use it). vLLM's decode worker names the blocks it keeps in its answer's `kv_transfer_params`; the next
turn's prefill reads them back when given them, without checking that they are the new prompt's
beginning. So an entry only points, and is given to a prefill only when the turn's prompt tokens (vLLM's
/tokenize) begin with the kept ones; the prefill's answer is checked again (its prompt token ids)."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvhandoff.router.answer import UpstreamError
from kvhandoff.wire import vllm as V
from kvhandoff.wire.cost import REUSE_FLOOR_TOKENS
from kvhandoff.wire.http import CHAT, COMPLETIONS
from kvhandoff.wire.modes import FinishReason, Role

if TYPE_CHECKING:
    from kvhandoff.router.vllm import VllmAttempt

log = logging.getLogger("kvhandoff.router")
# A retained turn is trusted for this much less than the decode workers' TTL: the router's clock and
# theirs started apart, and a read of freed blocks costs a failed prefill.
TTL_MARGIN_S = 10.0

@dataclass
class VllmSessionEntry:
    key: str                        # the client's session id, or "anon:<hash>"
    decode_url: str
    params: dict                    # the decode worker's kv_transfer_params, as they came
    token_ids: list[int]            # the tokens whose KV it keeps (its remote_num_tokens of them)
    expiry: float                   # time.monotonic()
    match_key: str                  # what an anonymous next turn is found by (conversation_keys)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def extended_by(self, answer: dict, remote: V.RemoteKV) -> bool:
        """After the prefill answered: did its prompt begin with the kept tokens, and were they read?
        (The router checked the prompt's tokens before; this is the check on what vLLM did.)"""
        choice = (answer.get("choices") or [{}])[0]
        prompt = answer.get("prompt_token_ids") or choice.get("prompt_token_ids")
        if choice.get("finish_reason") not in (FinishReason.LENGTH, FinishReason.STOP):
            return False                # (kv_load_failure_policy fail: the read failed)
        return prompt is not None and prompt[:self.num_tokens] == self.token_ids


def conversation_keys(endpoint: str, body: dict) -> list[str]:
    """The keys an anonymous conversation's earlier turns could be kept under, longest first: a chat's
    message list without its last k messages (k >= 1), a completion's prompt (a kept turn's prompt plus
    its answer is matched as a text prefix: completion_prefix_key)."""
    if endpoint != CHAT:
        return []
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    return [messages_key(messages[:k]) for k in range(len(messages) - 1, 0, -1)]


def messages_key(messages: list) -> str:
    canon = [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m for m in messages]
    return hashlib.sha256(json.dumps(canon, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]


class VllmSessions:
    """Where each conversation's KV is kept on vLLM decode workers: by the client's session id, else
    by its text (chat messages; a completion's prompt and answer). An entry only points: the turn's
    prompt tokens are compared with the kept ones before its prefill is given them (vLLM would read
    them unchecked), so a stale or edited history costs a recompute, never a wrong token."""

    def __init__(self, router, ttl_s: float = 480.0, max_entries: int = 10_000):
        self.router, self.ttl_s, self.max_entries = router, ttl_s, max_entries
        self.entries: OrderedDict[str, VllmSessionEntry] = OrderedDict()
        self.by_match: dict[str, str] = {}          # match key -> entry key

    async def find(self, attempt: VllmAttempt) -> VllmSessionEntry | None:
        entry, why = self.lookup(attempt), None
        if entry is None:
            return None
        holder = self.router.pool.find(entry.decode_url)
        if holder is None or not holder.healthy:
            why = f"the decode worker keeping it ({entry.decode_url}) is gone or unhealthy"
        elif entry.num_tokens < REUSE_FLOOR_TOKENS:
            why = f"{entry.num_tokens} kept tokens, fewer than the floor {REUSE_FLOOR_TOKENS}"
        else:
            prompt = await self.tokenize(attempt)
            if prompt is None:
                why = "its prompt could not be tokenized (/tokenize)"
            elif len(prompt) <= entry.num_tokens or prompt[:entry.num_tokens] != entry.token_ids:
                why = "the prompt's tokens do not begin with the kept ones (the history was edited)"
        if why is not None:
            self.count("recomputed")
            attempt.reuse_decision = {"choice": "recompute", "reason": why, "kept_tokens": entry.num_tokens}
            if holder is None or not holder.healthy:
                self.forget(entry)
            return None
        self.count("fetched")
        attempt.reuse = entry
        attempt.reuse_decision = {"choice": "fetch", "kept_tokens": entry.num_tokens, "decode_worker": entry.decode_url}
        return entry

    def lookup(self, attempt: VllmAttempt) -> VllmSessionEntry | None:
        now = time.monotonic()
        keys = [attempt.session_id] if attempt.session_id is not None else \
            [self.by_match.get(k) for k in conversation_keys(attempt.endpoint, attempt.body)]
        if attempt.session_id is None and attempt.endpoint == COMPLETIONS:
            keys = self.completion_candidates(attempt.body.get("prompt"))
        for key in keys:
            entry = self.entries.get(key) if key else None
            if entry is None:
                continue
            if entry.expiry <= now:
                self.forget(entry)
                continue
            return entry
        return None

    def completion_candidates(self, prompt) -> list[str]:
        """Anonymous completions: the kept turns whose prompt-plus-answer text begins this prompt."""
        if not isinstance(prompt, str):
            return []
        found = [(len(m), k) for m, k in self.by_match.items() if m.startswith("text:") and prompt.startswith(m[5:])]
        return [k for _, k in sorted(found, reverse=True)]

    async def tokenize(self, attempt: VllmAttempt) -> list[int] | None:
        """The turn's prompt tokens, from a prefill worker's /tokenize (the chat template applied as the
        serving endpoint applies it)."""
        body = attempt.body
        query = {"model": body.get("model")}
        if attempt.chat:
            query.update(messages=body.get("messages"), add_generation_prompt=True)
            for key in ("tools", "chat_template", "chat_template_kwargs", "add_special_tokens"):
                if key in body:
                    query[key] = body[key]
        else:
            query["prompt"] = body.get("prompt")
        worker = self.router.pool.least_loaded(Role.PREFILL)
        try:
            status, data = await self.router.upstream.call("POST", worker.url + "/tokenize", query, timeout=5.0)
        except UpstreamError as e:
            log.info("handoff %s: /tokenize on %s failed (%s): no reuse", attempt.handoff_id, worker.url, e)
            return None
        tokens = data.get("tokens") if status == 200 and isinstance(data, dict) else None
        return tokens if isinstance(tokens, list) else None

    def keep(self, attempt: VllmAttempt, answer: dict) -> None:
        """A decode worker's non-streamed answer: where it keeps this turn's KV, if it says."""
        params = answer.get("kv_transfer_params")
        choice = (answer.get("choices") or [{}])[0]
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            return                          # (not kept: no bidirectional_kv_xfer, or not a finished turn)
        try:
            kept = V.parse_remote(params, "the decode worker's kv_transfer_params")
        except ValueError as exc:
            log.warning("handoff %s: %s", attempt.handoff_id, exc)
            return
        prompt = answer.get("prompt_token_ids") or choice.get("prompt_token_ids") or attempt.prompt_ids
        output = choice.get("token_ids")
        if prompt is None or output is None or kept.blocks == 0:
            return
        text = (choice.get("message") or {}).get("content") if attempt.chat else choice.get("text")
        if attempt.chat:
            match = messages_key(list(attempt.body.get("messages") or []) + [{"role": "assistant", "content": text}])
        else:
            match = "text:" + (attempt.body.get("prompt") if isinstance(attempt.body.get("prompt"), str) else "") + (text or "")
        key = attempt.session_id or f"anon:{match[:48]}"
        if attempt.reuse is not None and attempt.reuse.key != key:
            self.forget(attempt.reuse)
        entry = VllmSessionEntry(key, attempt.decode.url, params, (prompt + output)[:kept.remote_num_tokens],
                                 time.monotonic() + self.ttl_s - TTL_MARGIN_S, match)
        self.record(entry)
        self.count("kept")

    def count(self, outcome: str) -> None:
        metrics = self.router.metrics
        metrics.child(metrics.vllm_reuse, outcome).inc()

    def record(self, entry: VllmSessionEntry) -> None:
        old = self.entries.pop(entry.key, None)
        if old is not None:
            self.by_match.pop(old.match_key, None)
        self.entries[entry.key] = entry
        self.by_match[entry.match_key] = entry.key
        while len(self.entries) > self.max_entries:
            self.forget(next(iter(self.entries.values())))

    def forget(self, entry: VllmSessionEntry) -> None:
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
            self.by_match.pop(entry.match_key, None)

    def remember(self, attempt: VllmAttempt, retained=None) -> dict | None:
        """Router.merged's hook: what the client's handoff object shows of where its conversation is kept
        now. (The keeping itself happened when the decode answer said where: keep().)"""
        entry = self.entries.get(attempt.session_id) if attempt.session_id else None
        if entry is None or entry.decode_url != attempt.decode.url:
            return None
        return {"decode_worker": entry.decode_url, "num_tokens": entry.num_tokens,
                "expires_in_s": round(entry.expiry - time.monotonic(), 3), "session": entry.key}
