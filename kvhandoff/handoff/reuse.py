"""Prefill side of bidirectional reuse: is fetching a conversation's retained KV worth it?

The router names a candidate (where a previous turn's KV lives and the hash chain of its tokens). This
module checks how much of it is truly a prefix of the new prompt (block hashes: an edited history
stops the match at the first differing block), then weighs fetching those blocks (bytes / measured
reverse-read bandwidth, plus the measured fixed cost of a fetch) against recomputing the tokens this
worker does not already hold (tokens / measured prefill rate). Below a floor, or when the KV expires
within a safety margin, it does not fetch at all. Estimates start from conservative defaults and
follow what this worker measures (exponentially weighted).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

POLICIES = ("cost", "always")


@dataclass
class ReuseConfig:
    min_tokens: int = 64                # never fetch fewer reusable tokens than this
    policy: str = "cost"                # cost: fetch only when cheaper; always: whenever above the floor
    expiry_margin_s: float = 5.0        # decline KV that expires sooner than this (plus the fetch itself)

    def __post_init__(self):
        assert self.policy in POLICIES, f"reuse policy must be one of {POLICIES}"
        assert self.min_tokens >= 0 and self.expiry_margin_s >= 0


@dataclass
class ReuseDecision:
    decision: str                       # "fetched", "recomputed" or "none"
    reason: str
    reusable_tokens: int = 0
    est_fetch_ms: float | None = None
    est_recompute_ms: float | None = None
    fetch_ms: float | None = None       # measured, when fetched

    def report(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class CostModel:
    """What fetching and recomputing cost on this worker, learned from what it did."""
    ALPHA = 0.3                         # weight of the newest measurement

    def __init__(self, bandwidth_bps: float = 2e8, fetch_overhead_s: float = 0.02, prefill_tps: float = 500.0):
        # Defaults err towards recomputing: a slow link and a fast prefill, until measured.
        self.bandwidth_bps, self.fetch_overhead_s, self.prefill_tps = bandwidth_bps, fetch_overhead_s, prefill_tps
        self.measured = {"fetches": 0, "prefills": 0}
        self._lock = threading.Lock()

    def _ewma(self, old: float, new: float, first: bool) -> float:
        return new if first else (1 - self.ALPHA) * old + self.ALPHA * new

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens < 16 or seconds <= 0:
            return                      # too small to say anything about the rate
        with self._lock:
            self.prefill_tps = self._ewma(self.prefill_tps, tokens / seconds, self.measured["prefills"] == 0)
            self.measured["prefills"] += 1

    def observe_fetch(self, nbytes: int, transfer_s: float, total_s: float) -> None:
        if nbytes <= 0 or transfer_s <= 0:
            return
        with self._lock:
            first = self.measured["fetches"] == 0
            self.bandwidth_bps = self._ewma(self.bandwidth_bps, nbytes / transfer_s, first)
            self.fetch_overhead_s = self._ewma(self.fetch_overhead_s, max(0.0, total_s - transfer_s), first)
            self.measured["fetches"] += 1

    def fetch_s(self, nbytes: int) -> float:
        return self.fetch_overhead_s + nbytes / self.bandwidth_bps

    def recompute_s(self, tokens: int) -> float:
        return tokens / self.prefill_tps


def common_prefix_blocks(prompt_hashes: list[bytes], retained_hashes: list[str]) -> int:
    """How many leading full blocks the new prompt shares with the retained tokens."""
    n = 0
    for ours, theirs in zip(prompt_hashes, retained_hashes):
        if ours.hex() != theirs:
            break
        n += 1
    return n


def decide(cfg: ReuseConfig, model: CostModel, prompt_len: int, prompt_hashes: list[bytes], candidate: dict,
           block_size: int, block_bytes: int, locally_cached_blocks: int) -> tuple[ReuseDecision, int]:
    """(decision, number of leading blocks to fetch). At least one prompt token is always computed
    here (it yields the first output token), so at most (prompt_len - 1) // block_size blocks."""
    hashes = candidate.get("block_hashes") or []
    blocks = min(common_prefix_blocks(prompt_hashes, hashes), (prompt_len - 1) // block_size)
    tokens = blocks * block_size
    if blocks == 0:
        why = "the prompt does not start with the retained tokens (history edited?)" if hashes else \
              "the retained KV has no full block"
        return ReuseDecision("none", why), 0
    diverged = blocks < len(hashes) and blocks < (prompt_len - 1) // block_size
    note = f" (history differs after token {tokens})" if diverged else ""
    if tokens < cfg.min_tokens:
        return ReuseDecision("recomputed", f"{tokens} reusable tokens, below the floor of {cfg.min_tokens}{note}",
                             tokens), 0
    if locally_cached_blocks >= blocks:
        return ReuseDecision("none", f"this worker's prefix cache already holds the {tokens} reusable tokens",
                             tokens), 0
    fetch_s = model.fetch_s(blocks * block_bytes)
    recompute_s = model.recompute_s((blocks - locally_cached_blocks) * block_size)
    decision = ReuseDecision("fetched", f"{tokens} reusable tokens{note}", tokens,
                             round(fetch_s * 1e3, 3), round(recompute_s * 1e3, 3))
    expires_in = candidate.get("expires_in_s")
    if isinstance(expires_in, (int, float)) and expires_in < cfg.expiry_margin_s + fetch_s:
        decision.decision, decision.reason = "recomputed", f"the retained KV expires in {expires_in:.1f} s"
        return decision, 0
    if cfg.policy == "cost" and fetch_s >= recompute_s:
        decision.decision = "recomputed"
        decision.reason = (f"recomputing {tokens} tokens (~{recompute_s * 1e3:.0f} ms) beats fetching them "
                           f"(~{fetch_s * 1e3:.0f} ms){note}")
        return decision, 0
    return decision, blocks
