"""A generation request as the engine sees it: its tokens, sampling parameters, state and timestamps."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

from kvhandoff.wire.modes import FinishReason  # (the vocabulary leaf: see its docstring)


class RequestState(Enum):
    WAITING = auto()            # queued for prefill here
    WAITING_REMOTE = auto()     # the K/V of its first `remote_tokens` comes from elsewhere: queued for blocks
    WAITING_FOR_KV = auto()     # blocks reserved, the K/V on its way; not schedulable until it lands
    RUNNING = auto()            # holds blocks; prefilling (chunk by chunk) or decoding
    FINISHED = auto()


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0            # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def validate(self) -> None:
        """Raise ValueError with a message that tells the caller what to fix."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be between 0 and max_tokens, got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class Timings:
    arrival: float = 0.0
    first_scheduled: float | None = None
    kv_ready: float | None = None       # remote KV verified and queued (decode side of a handoff)
    first_token: float | None = None
    second_token: float | None = None   # decode side of a handoff: the end of its first forward step
    finished: float | None = None

    def as_ms(self, num_output_tokens: int = 0) -> dict[str, float]:
        def ms(a, b):
            return round((b - a) * 1000, 3) if a is not None and b is not None else None
        after_second = ms(self.second_token, self.finished)
        # The engine's own time per token after the second (a handoff's decode side and a colocated
        # request alike: the steps that follow their first decode step), beside what the client saw.
        step = {"decode_step_ms": round(after_second / (num_output_tokens - 2), 4)} \
            if after_second is not None and num_output_tokens > 2 else {}
        return {
            "queue_ms": ms(self.arrival, self.first_scheduled),
            "prefill_ms": ms(self.first_scheduled, self.first_token),
            "ttft_ms": ms(self.arrival, self.first_token),
            "decode_ms": ms(self.first_token, self.finished),
            "total_ms": ms(self.arrival, self.finished),
            **({"decode_queue_ms": ms(self.kv_ready, self.first_scheduled),
                "first_step_ms": ms(self.first_scheduled, self.second_token)} if self.kv_ready else {}),
            **step,
        }


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0        # tokens whose K/V are in this request's blocks
    num_cached_tokens: int = 0          # of those, how many came from the prefix cache
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)    # chain hashes of full computed blocks
    # Disaggregation: a prefill-only request computes the whole prompt's KV and samples the first
    # token, then finishes with its blocks pinned for the handoff.
    prefill_only: bool = False
    retain: bool = False                # bidirectional: keep the KV after a normal finish (Hold.RETAINED)
    # The K/V of the first `remote_tokens` prompt tokens comes from another worker (the connector
    # loads it into blocks the scheduler reserves): the whole prompt on a decode worker, a retained
    # history on a prefill worker that reuses it. 0: everything is computed here.
    remote_tokens: int = 0
    finish_reason: FinishReason | None = None
    timings: Timings = field(default_factory=lambda: Timings(arrival=time.monotonic()))
    # Detokenization state (engine/detokenizer.py): the text so far and how much of it was emitted
    # (the rest is held back); the text of output_token_ids[:settled_offset], which ends on a whole
    # character, and where the tokens decoded again for context begin.
    output_text: str = ""
    emitted_chars: int = 0
    settled_text: str = ""
    settled_offset: int = 0
    context_offset: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_target_tokens(self) -> int:
        """Tokens whose K/V must be computed before this request samples its next token."""
        return self.num_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(frozen=True)
class Resume:
    """A generation continued from where another worker left it (request migration): the tokens
    already sent to the client, and how much of their text was (the detokenizer's state), so the
    next text is exactly what the first worker would have streamed."""
    output_token_ids: list[int]
    emitted_chars: int = 0


@dataclass
class RequestOutput:
    """What one engine step produced for one request (streamed to the caller)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    timings: dict | None = None         # set on the final output (Timings.as_ms)
    error: str | None = None            # set when finish_reason is "error"
    kv_block_ids: list[int] | None = None   # finish_reason "prefilled": the pinned blocks holding the KV
    num_kv_tokens: int = 0                  # ... how many tokens of K/V they hold (the whole prompt); the
                                            # first output token, sampled by the prefill, is new_token_ids[0]
    handoff: dict | None = None             # what the connector reports of the request's handoff
    retained: "RetainedKV | None" = None    # a `retain` request's KV, kept after it finished


@dataclass
class RetainedKV:
    """A finished request's KV kept for a later turn of its conversation (bidirectional reuse). Its
    blocks hold the K/V of `token_ids` (prompt and answer but the last answer token, never computed)."""
    retention_id: str
    block_ids: list[int]
    token_ids: list[int]
    block_hashes: list[bytes]           # chain hashes of its full blocks
    readers: int = 0                    # reverse reads in flight: not evictable while > 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
