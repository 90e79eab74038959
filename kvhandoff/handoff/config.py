"""A worker's handoff settings (`kvhandoff serve` flags), in one place."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.handoff.faults import Faults

REUSE_POLICIES = ("cost", "always")


@dataclass
class RetentionConfig:
    """Decode side of bidirectional reuse: how long and how much finished turns' KV is kept."""
    ttl_s: float = 480.0
    max_bytes: int | None = None        # None: no cap of its own (the pool's size still bounds it)
    read_lease_s: float = 15.0          # a reverse read that has not reported back by then lost its lease

    def __post_init__(self):
        assert self.ttl_s > 0 and self.read_lease_s > 0
        assert self.max_bytes is None or self.max_bytes >= 0


@dataclass
class ReuseConfig:
    """Prefill side of bidirectional reuse: when reading retained history back beats recomputing it."""
    min_tokens: int = 64                # never fetch fewer tokens than this (those that would move)
    policy: str = "cost"                # cost: fetch only when cheaper; always: whenever above the floor
    expiry_margin_s: float = 5.0        # decline KV that expires sooner than this (plus the fetch itself)

    def __post_init__(self):
        assert self.policy in REUSE_POLICIES, f"reuse policy must be one of {REUSE_POLICIES}"
        assert self.min_tokens >= 0 and self.expiry_margin_s >= 0


@dataclass
class HandoffConfig:
    lease_s: float = 30.0               # pull: how long prefill keeps blocks for a decode that has not read
    kv_timeout_s: float = 30.0          # push: how long either side waits for the other (registration ttl)
    failure_policy: str = "recompute"   # decode side: recompute | fail when KV cannot be loaded
    bidirectional: bool = False         # keep finished turns' KV (decode) and read it back (prefill)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    faults: Faults = field(default_factory=Faults)       # tests only: kvhandoff serve --inject-faults

    def __post_init__(self):
        assert self.failure_policy in ("recompute", "fail"), self.failure_policy

    @property
    def recompute(self) -> bool:
        return self.failure_policy == "recompute"
