"""A worker's handoff settings (`kvhandoff serve` flags), in one place."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.wire.cost import ReuseConfig
from kvhandoff.wire.modes import FailurePolicy
from kvhandoff.worker.faults import Faults


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
class HandoffConfig:
    lease_s: float = 30.0               # pull: how long prefill keeps blocks for a decode that has not read
    kv_timeout_s: float = 30.0          # push: how long either side waits for the other (registration ttl)
    failure_policy: FailurePolicy = FailurePolicy.RECOMPUTE      # decode side, when KV cannot be loaded
    bidirectional: bool = False         # keep finished turns' KV (decode) and read it back (prefill)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    faults: Faults = field(default_factory=Faults)       # tests only: kvhandoff serve --inject-faults

    def __post_init__(self):
        self.failure_policy = FailurePolicy(self.failure_policy)

    @property
    def recompute(self) -> bool:
        return self.failure_policy is FailurePolicy.RECOMPUTE
