"""The limit probe's arithmetic (kvhandoff.bench.limits): the model's work from its dimensions, and
the floors it implies. Checked against figures known independently of this code."""
from __future__ import annotations

import pytest
import torch

from kvhandoff.bench.limits import MachineRates, ModelWork, paired_decode_floor
from kvhandoff.config import ModelConfig

SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                           num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


def test_smollm2_work_matches_its_published_size():
    work = ModelWork.of(SMOLLM2_135M, torch.float32)
    # Hugging Face reports 134,515,008 parameters for SmolLM2-135M (tied embedding counted once).
    assert work.linear_params + work.head_params + work.other_bytes // 4 == 134_515_008
    # A decode step at 1,024 context reads every weight once plus the K/V: ~585 MB in fp32 (issue 12 says ~584).
    nbytes, flops = work.decode_step(1, 1024)
    assert nbytes == pytest.approx(585.2e6, rel=1e-3)
    assert flops == 2 * 134_479_872 + 4 * 1024 * 576 * 30


def test_prefill_flops_count_causal_pairs_and_the_cache():
    work = ModelWork.of(SMOLLM2_135M, torch.float32)
    matmul, attention = work.prefill_flops(1024)
    assert matmul == 2 * 1024 * work.linear_params + 2 * work.head_params      # the head for the last token only
    assert attention == 4 * (1024 * 1025 / 2) * 576 * 30
    _, cached = work.prefill_flops(328, 1792)
    _, alone = work.prefill_flops(328)
    assert cached - alone == 4 * 328 * 1792 * 576 * 30     # each new token also attends to every cached one


def test_decode_floor_is_bandwidth_or_compute_whichever_is_slower():
    work = ModelWork.of(SMOLLM2_135M, torch.float32)
    rates = MachineRates(threads=1, dtype="float32", matmul_gflops=40.0, read_gbps=15.0)
    one = rates.decode_step_floor_s(work, 1, 1024)
    assert one == pytest.approx(585.2e6 / 15e9, rel=1e-3)           # memory-bound: ~39 ms
    many = rates.decode_step_floor_s(work, 64, 1024)
    _, flops = work.decode_step(64, 1024)
    assert many == pytest.approx(flops / 40e9)                       # 64 sequences: compute-bound
    assert rates.prefill_floor_s(work, 1024) == pytest.approx(sum(work.prefill_flops(1024)) / 40e9)


def test_each_round_is_set_beside_the_floor_at_its_own_read_rate():
    """A round run while other tenants halved the read rate took twice as long: against its own floor
    it is as close as the others (a ratio of medians would call it 1.5x off)."""
    work = ModelWork.of(SMOLLM2_135M, torch.float32)
    rates = MachineRates(threads=1, dtype="float32", matmul_gflops=1e6, read_gbps=99.0)   # read_gbps unused
    floor_at_20 = 585.2e6 / 20e9 * 1e3
    paired = paired_decode_floor(rates, work, 1, 1024, [1.2 * floor_at_20, 2.4 * floor_at_20, 1.2 * floor_at_20],
                                 [20.0, 10.0, 20.0])
    assert paired.x_per_round == pytest.approx([1.2, 1.2, 1.2], rel=1e-3)
    assert paired.x_floor == pytest.approx(1.2, rel=1e-3) and paired.floor_ms == pytest.approx(floor_at_20, rel=1e-3)
    with pytest.raises(AssertionError):
        paired_decode_floor(rates, work, 1, 1024, [1.0, 2.0], [20.0])      # a round without its rate
