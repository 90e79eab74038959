"""What the machine allows: measured matrix throughput and memory read bandwidth, and from the model's
dimensions the floor of each engine figure (issue 12's limit probe).

A floor is the time the work would take if it ran at the measured rate and did nothing else:
  prefill   matmul FLOPs of every prompt token (the head only for the last) plus causal attention,
            at the throughput measured at the prefill's own shapes;
  decode    per step, the bytes it must read (every weight once, the head included, plus each
            sequence's K/V) at the measured read bandwidth, or its FLOPs at the matmul throughput,
            whichever takes longer.
So a figure's ratio to its floor says how much of the machine the engine leaves unused.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from kvhandoff.config import ModelConfig
from kvhandoff.model.kernels import core_handoff_ns


@dataclass(frozen=True)
class ModelWork:
    """The model's work per token, from its dimensions."""
    linear_params: int          # parameters of every layer's projections (what each token multiplies)
    head_params: int            # the output projection over the vocabulary (tied or not)
    other_bytes: int            # norms: read every step, negligible but counted
    attention_width: int        # num_heads * head_dim: FLOPs per (query, key) pair are 4x this per layer
    num_layers: int
    kv_bytes_per_token: int
    element_size: int

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: torch.dtype) -> "ModelWork":
        el = torch.empty((), dtype=dtype).element_size()
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
        norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
        return cls(per_layer * cfg.num_layers, cfg.vocab_size * cfg.hidden_size, norms * el, q, cfg.num_layers,
                   cfg.kv_bytes_per_token(el), el)

    def prefill_flops(self, new_tokens: int, cached_tokens: int = 0) -> tuple[float, float]:
        """(matmul, attention) FLOPs of a prefill of `new_tokens` after `cached_tokens` already in the
        pool: each new token attends to the cache and, causally, to the new tokens before it."""
        matmul = 2 * new_tokens * self.linear_params + 2 * self.head_params
        pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
        return matmul, 4 * pairs * self.attention_width * self.num_layers

    def decode_step(self, num_seqs: int, context: int) -> tuple[float, float]:
        """(bytes read, FLOPs) of one decode step of `num_seqs` sequences at `context` tokens each."""
        weights = (self.linear_params + self.head_params) * self.element_size + self.other_bytes
        flops = num_seqs * (2 * (self.linear_params + self.head_params) + 4 * context * self.attention_width * self.num_layers)
        return weights + num_seqs * context * self.kv_bytes_per_token, flops


@dataclass
class MachineRates:
    threads: int
    dtype: str
    matmul_gflops: float        # at the prefill's shapes (prompt_len rows through every projection)
    read_gbps: float            # streaming read of a buffer far beyond the caches

    def prefill_floor_s(self, work: ModelWork, new_tokens: int, cached_tokens: int = 0) -> float:
        matmul, attention = work.prefill_flops(new_tokens, cached_tokens)
        return (matmul + attention) / (self.matmul_gflops * 1e9)

    def decode_step_floor_s(self, work: ModelWork, num_seqs: int, context: int) -> float:
        nbytes, flops = work.decode_step(num_seqs, context)
        return max(nbytes / (self.read_gbps * 1e9), flops / (self.matmul_gflops * 1e9))


@dataclass(frozen=True)
class PairedFloor:
    """A decode figure over rounds, each round beside the floor at the read rate measured with it."""
    floor_ms: float                 # the median of the rounds' floors
    x_floor: float                  # the median of the rounds' own ratios (not a ratio of medians)
    x_per_round: list[float]


def paired_decode_floor(rates: MachineRates, work: ModelWork, num_seqs: int, context: int,
                        step_ms_per_round: list[float], read_gbps_per_round: list[float]) -> PairedFloor:
    assert len(step_ms_per_round) == len(read_gbps_per_round) > 0
    floors = [replace(rates, read_gbps=gbps).decode_step_floor_s(work, num_seqs, context) * 1e3
              for gbps in read_gbps_per_round]
    ratios = [ms / floor for ms, floor in zip(step_ms_per_round, floors)]
    return PairedFloor(statistics.median(floors), statistics.median(ratios), ratios)


def _median_time(fn, repeats: int) -> float:
    fn()                                                    # warm-up: kernel selection, page faults
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def measure_matmul_gflops(cfg: ModelConfig, dtype: torch.dtype, rows: int, repeats: int = 3) -> float:
    """One layer's projections (qkv, o, gate_up, down) on `rows` tokens, as the prefill runs them."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    weights = [torch.randn(out, inp).to(dtype) for out, inp in shapes]
    inputs = [torch.randn(rows, inp).to(dtype) for _, inp in shapes]
    flops = sum(2 * rows * out * inp for out, inp in shapes)

    def run():
        for x, w in zip(inputs, weights):
            F.linear(x, w)
    return flops / _median_time(run, repeats) / 1e9


def read_buffer(nbytes: int = 512 << 20) -> torch.Tensor:
    """A buffer far larger than any cache, for measure_read_gbps (allocated and touched once)."""
    return torch.ones(nbytes // 4, dtype=torch.float32)


def measure_read_gbps(nbytes: int = 512 << 20, repeats: int = 5, buffer: torch.Tensor | None = None) -> float:
    """Streaming read: a sum over a buffer far larger than any cache (the sum's arithmetic is far
    cheaper than the bytes, so the memory is what it measures)."""
    buffer = read_buffer(nbytes) if buffer is None else buffer
    return buffer.numel() * buffer.element_size() / _median_time(buffer.sum, repeats) / 1e9


class RoundReadRates:
    """The read rate measured right after each round of a decode figure, so that every round is set
    beside its own floor (paired_decode_floor): one buffer for the whole run, three timed sums a round.
    With `handoffs`, also how long a cache line took between two cores (kernels.core_handoff_ns): a VM's
    two vCPUs sit on one CCX (~30-50 ns) or on two CCDs (~170 ns), and two threads' steps differ with it."""

    def __init__(self):
        self.buffer = read_buffer()

    def after(self, runs: dict[str, list[float]], handoffs: dict[str, list[float]] | None = None):
        """A callback for the bench's run_pair: the rate, appended to runs[side] for the sides it has
        (and the handoff time to handoffs[side])."""
        def record(side: str) -> None:
            if side in runs:
                runs[side].append(round(measure_read_gbps(repeats=3, buffer=self.buffer), 2))
            if handoffs and side in handoffs:
                ns = core_handoff_ns()
                if ns is not None:
                    handoffs[side].append(round(ns, 1))
        return record


def probe(cfg: ModelConfig, dtype: torch.dtype, threads: int, prefill_rows: int) -> MachineRates:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return MachineRates(threads, str(dtype).removeprefix("torch."),
                            measure_matmul_gflops(cfg, dtype, prefill_rows), measure_read_gbps())
    finally:
        torch.set_num_threads(previous)


def as_dict(rates: MachineRates) -> dict:
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(rates).items()}
