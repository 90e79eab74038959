"""The reuse cost model both sides price with, and its one vocabulary.

A prefill worker measures what its prefills and reverse reads cost (CostModel), reports the rates in
/health, and decides for itself whether to fetch a conversation's retained history or recompute it
(`decide`). The router prices the same choice across prefill workers from those rates
(router/policies.py, `reuse_estimate`) before a worker is picked. Both speak `ReuseWay`: what a
prefill does with a history a decode worker retains."""
from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from kvhandoff.wire import messages as M


class ReuseWay(StrEnum):
    """Route_decision's `choice` (the router's estimate) and reuse_decision's `decision` (the
    prefill worker's, with exact figures)."""
    CACHE = "cache"             # the prefill worker's own prefix cache holds the history
    FETCH = "fetch"             # read the retained blocks it lacks back from the decode worker
    RECOMPUTE = "recompute"     # compute the history again (cheaper, too short to move, or a failed fetch)
    NONE = "none"               # nothing to reuse: no retained history, or the prompt does not extend it


class ReusePolicy(StrEnum):
    COST = "cost"               # fetch only when cheaper than recomputing
    ALWAYS = "always"           # fetch whenever above the floor


@dataclass
class ReuseConfig:
    """Prefill side of bidirectional reuse: when reading retained history back beats recomputing it."""
    min_tokens: int = 64                # never fetch fewer tokens than this (those that would move)
    policy: ReusePolicy = ReusePolicy.COST
    expiry_margin_s: float = 5.0        # decline KV that expires sooner than this (plus the fetch itself)

    def __post_init__(self):
        self.policy = ReusePolicy(self.policy)
        assert self.min_tokens >= 0 and self.expiry_margin_s >= 0


# The floor the router prices with: a worker's own `--reuse-min-tokens` may differ, and decides.
REUSE_FLOOR_TOKENS = ReuseConfig().min_tokens


@dataclass
class ReuseDecision:
    decision: ReuseWay
    reason: str
    reusable_tokens: int = 0
    local_tokens: int | None = None     # of those, what this worker's prefix cache holds (never fetched)
    est_fetch_ms: float | None = None
    est_recompute_ms: float | None = None
    fetch_ms: float | None = None       # measured, when fetched

    def report(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class PrefillCost:
    """Milliseconds a prefill takes to compute `tokens` new tokens after `context` tokens whose K/V it
    already has: a fixed cost per prefill (a forward pass's overhead), a cost per token, and a cost per
    token that grows with what it attends to (token i sees context + i keys):
        ms = fixed_ms + tokens * ms_per_ktok / 1e3 + tokens * (context + tokens / 2) * ms_per_ktok_kctx / 1e6
    The last term is why 328 tokens after 1,792 cached cost twice what the same 328 cost alone; a
    rate per token alone misjudges both a short fetch (where the fixed cost is paid anyway) and a long
    history (where each token costs more)."""
    fixed_ms: float = 20.0
    ms_per_ktok: float = 2000.0         # 500 tokens/s until measured
    ms_per_ktok_kctx: float = 0.0

    @staticmethod
    def features(tokens: int, context: int) -> tuple[float, float, float]:
        return 1.0, tokens / 1e3, tokens * (context + tokens / 2) / 1e6

    def ms(self, tokens: int, context: int = 0) -> float:
        """A whole prefill of `tokens` (nothing: 0 ms)."""
        return self.fixed_ms + self.extra_ms(tokens, context) if tokens > 0 else 0.0

    def extra_ms(self, tokens: int, context: int = 0) -> float:
        """What `tokens` more add to a prefill that runs anyway (no fixed cost): the price of
        recomputing history on a worker that computes the new input regardless."""
        _, per_token, attention = self.features(tokens, context)
        return per_token * self.ms_per_ktok + attention * self.ms_per_ktok_kctx

    def rates(self) -> dict:
        return {"prefill_fixed_ms": round(self.fixed_ms, 3), "prefill_ms_per_ktok": round(self.ms_per_ktok, 3),
                "prefill_ms_per_ktok_kctx": round(self.ms_per_ktok_kctx, 3)}


def fit_prefill_cost(observed: list[tuple[int, int, float]], prior: PrefillCost, prior_weight: float = 0.01) -> PrefillCost:
    """Least squares of PrefillCost over (tokens, context, ms) observations, no coefficient negative,
    with a faint pull (`prior_weight` of one observation) towards `prior`: it decides only what the
    observations leave open (one observation, or prompts that all start from an empty cache, cannot
    separate the three terms). Three coefficients: every subset of them is solved and the best
    non-negative solution kept (exact NNLS at this size)."""
    x = np.array([PrefillCost.features(n, c) for n, c, _ in observed], dtype=float).reshape(-1, 3)
    y = np.array([ms for _, _, ms in observed], dtype=float)
    theta0 = np.array([prior.fixed_ms, prior.ms_per_ktok, prior.ms_per_ktok_kctx])
    # The prior as pseudo-rows, each scaled to a typical observation (300 tokens, 1,000 of context).
    scale = np.sqrt(prior_weight) * np.array([1.0, 0.3, 0.35])
    best, best_loss = theta0, float("inf")
    for mask in itertools.product((True, False), repeat=3):
        keep = np.array(mask)
        if not keep.any():
            continue
        # min |x theta - y|^2 + |scale (theta - theta0)|^2 with the coefficients not kept at 0
        rows = np.vstack([x[:, keep], np.diag(scale)[:, keep]])
        target = np.concatenate([y, scale * theta0])
        theta = np.zeros(3)
        theta[keep] = np.linalg.lstsq(rows, target, rcond=None)[0]
        if (theta < 0).any():
            continue
        loss = float(np.sum((x @ theta - y) ** 2) + np.sum((scale * (theta - theta0)) ** 2))
        if loss < best_loss:
            best, best_loss = theta, loss
    return PrefillCost(*map(float, best))


class CostModel:
    """What fetching and recomputing cost on this worker, learned from what it did: the prefill's
    PrefillCost refitted over its last WINDOW prefills, the reverse read's bandwidth and fixed cost as
    moving averages."""
    ALPHA = 0.3                         # weight of the newest fetch measurement
    WINDOW = 64                         # prefills the prefill cost is fitted over

    def __init__(self, bandwidth_bps: float = 2e8, fetch_overhead_s: float = 0.02,
                 prefill: PrefillCost = PrefillCost()):
        # Defaults err towards recomputing: a slow link and a fast prefill, until measured.
        self.bandwidth_bps, self.fetch_overhead_s = bandwidth_bps, fetch_overhead_s
        self._prefill = self.prior = prefill
        self._stale = False             # observations came since the last fit
        self.observed: deque[tuple[int, int, float]] = deque(maxlen=self.WINDOW)
        self.measured = {"fetches": 0, "prefills": 0}
        self._lock = threading.Lock()

    def _ewma(self, old: float, new: float, first: bool) -> float:
        return new if first else (1 - self.ALPHA) * old + self.ALPHA * new

    def observe_prefill(self, tokens: int, context: int, seconds: float) -> None:
        """A prefill computed `tokens` after `context` tokens it had (cached or fetched) in `seconds`."""
        if tokens < 1 or seconds <= 0:
            return
        with self._lock:
            self.observed.append((tokens, context, seconds * 1e3))
            self._stale = True
            self.measured["prefills"] += 1

    @property
    def prefill(self) -> PrefillCost:
        """The prefill cost fitted to the observations, refitted when read after new ones. (Fitting
        where they are observed ran seven least-squares solves on the engine thread at the end of
        every prefill, between its first token and the client: ~1 ms of each TTFT.)"""
        with self._lock:
            if not self._stale:
                return self._prefill
            observed, self._stale = list(self.observed), False
        fitted = fit_prefill_cost(observed, self.prior)
        with self._lock:
            self._prefill = fitted
        return fitted

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

    def recompute_s(self, tokens: int, context: int) -> float:
        """Recomputing `tokens` of history after `context` tokens held here, within a prefill that
        runs anyway (the new input is always computed here)."""
        return self.prefill.extra_ms(tokens, context) / 1e3

    def rates(self) -> dict:
        """What /health reports, for the router to weigh this worker's cache against a fetch."""
        prefill = self.prefill          # (takes the lock itself)
        with self._lock:
            return {**prefill.rates(), "reverse_bps": round(self.bandwidth_bps),
                    "fetch_overhead_ms": round(self.fetch_overhead_s * 1e3, 3), **self.measured}

    @classmethod
    def from_rates(cls, rates: dict) -> CostModel:
        """The model a worker reported (`rates()` in its /health), for the router's estimates; what
        it left out (nothing measured yet, an older worker) stays at the defaults."""
        default = cls()
        prefill = PrefillCost(float(rates.get("prefill_fixed_ms", default.prefill.fixed_ms)),
                              float(rates.get("prefill_ms_per_ktok", default.prefill.ms_per_ktok)),
                              float(rates.get("prefill_ms_per_ktok_kctx", default.prefill.ms_per_ktok_kctx)))
        return cls(float(rates.get("reverse_bps", default.bandwidth_bps)),
                   float(rates.get("fetch_overhead_ms", default.fetch_overhead_s * 1e3)) / 1e3, prefill)


def common_prefix_blocks(ours: list[str], theirs: list[str]) -> int:
    """How many leading full blocks two hash chains (hex) share."""
    n = 0
    for mine, other in zip(ours, theirs):
        if mine != other:
            break
        n += 1
    return n


def decide(cfg: ReuseConfig, model: CostModel, prompt_len: int, prompt_hashes: list[bytes],
           candidate: M.ReuseCandidate, block_size: int, block_bytes: int,
           locally_cached_blocks: int) -> tuple[ReuseDecision, int]:
    """(decision, number of leading blocks to fetch). At least one prompt token is always computed
    here (it yields the first output token), so at most (prompt_len - 1) // block_size blocks."""
    hashes = candidate.block_hashes
    blocks = min(common_prefix_blocks([h.hex() for h in prompt_hashes], hashes), (prompt_len - 1) // block_size)
    tokens = blocks * block_size
    if blocks == 0:
        why = "the prompt does not start with the retained tokens (history edited?)" if hashes else \
              "the retained KV has no full block"
        return ReuseDecision(ReuseWay.NONE, why), 0
    diverged = blocks < len(hashes) and blocks < (prompt_len - 1) // block_size
    note = f" (history differs after token {tokens})" if diverged else ""
    if locally_cached_blocks >= blocks:
        return ReuseDecision(ReuseWay.CACHE, f"this worker's prefix cache already holds the {tokens} reusable tokens",
                             tokens), 0
    # Only what this worker's prefix cache lacks would move, and only that would be computed otherwise;
    # the floor is on what would move (a fetch has a fixed cost that a few tokens cannot repay).
    missing = blocks - locally_cached_blocks
    local = f", {locally_cached_blocks * block_size} of them cached here" if locally_cached_blocks else ""
    if missing * block_size < cfg.min_tokens:
        return ReuseDecision(ReuseWay.RECOMPUTE, f"{tokens} reusable tokens{local}: the {missing * block_size} that would "
                             f"move are below the floor of {cfg.min_tokens}{note}", tokens,
                             locally_cached_blocks * block_size), 0
    fetch_s = model.fetch_s(missing * block_bytes)
    recompute_s = model.recompute_s(missing * block_size, locally_cached_blocks * block_size)
    decision = ReuseDecision(ReuseWay.FETCH, f"{tokens} reusable tokens{local}{note}", tokens,
                             locally_cached_blocks * block_size, round(fetch_s * 1e3, 3), round(recompute_s * 1e3, 3))
    expires_in = candidate.expires_in_s
    if expires_in is not None and expires_in < cfg.expiry_margin_s + fetch_s:
        decision.decision, decision.reason = ReuseWay.RECOMPUTE, f"the retained KV expires in {expires_in:.1f} s"
        return decision, 0
    if cfg.policy is ReusePolicy.COST and fetch_s >= recompute_s:
        decision.decision = ReuseWay.RECOMPUTE
        decision.reason = (f"recomputing {tokens} tokens (~{recompute_s * 1e3:.0f} ms) beats fetching them "
                           f"(~{fetch_s * 1e3:.0f} ms){note}")
        return decision, 0
    return decision, blocks

