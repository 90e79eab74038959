"""The compiled CPU kernels (kvhandoff.model.kernels) against torch: the packed matmul against
F.linear at every batch shape the engine produces, paged attention against dense attention over the
same blocks, the packed model against the plain one, and a clean fallback when they cannot build."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvhandoff.config import ModelConfig
from kvhandoff.engine.request import Request, SamplingParams
from kvhandoff.engine.runner import ModelRunner
from kvhandoff.engine.scheduler import ScheduledChunk
from kvhandoff.model import kernels, paired_kv
from kvhandoff.model.llama import LlamaModel, RMSNorm, Rotary, prompt_logits


# Every machine CI has run on has AVX2, FMA and gcc: there the kernels must build, not quietly fall back.
pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= kernels.cpu_flags(), reason="the kernels need AVX2 and FMA")


def test_the_kernels_build_here():
    assert kernels.available(), kernels.status()
    assert kernels.status().startswith("on")


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 33, 300])
@pytest.mark.parametrize("out_features,in_features,bias", [(960, 576, False), (40, 128, True), (49, 17, False)])
def test_packed_linear_equals_f_linear(rows, out_features, in_features, bias):
    g = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    packed = kernels.PackedLinear(weight, b)
    torch.testing.assert_close(packed(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    # A strided input (a column slice, as q/k/v splits make) and leading batch dimensions.
    wide = torch.randn(rows, in_features + 3, generator=g)[:, 3:]
    torch.testing.assert_close(packed(wide), F.linear(wide, weight, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed(x.view(1, rows, -1)), F.linear(x, weight, b).view(1, rows, -1),
                               rtol=1e-5, atol=1e-4)
    ids = torch.tensor([0, out_features - 1, out_features // 2])
    assert torch.equal(packed.rows(ids), weight[ids])


def dense_attention(q, k_cache, v_cache, tables, row_seq, row_len, scale):
    """Each row's sequence's blocks gathered, then plain softmax attention over its first row_len tokens."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        blocks = tables[row_seq[r]]
        keys = k_cache[blocks].transpose(0, 1).flatten(1, 2)[:, :row_len[r]]        # [kv_heads, len, D]
        values = v_cache[blocks].transpose(0, 1).flatten(1, 2)[:, :row_len[r]]
        keys, values = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (keys, values))
        probs = torch.softmax((q[r].unsqueeze(1) @ keys.transpose(1, 2)) * scale, dim=-1)
        out[r] = (probs @ values).squeeze(1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 2, 32, 16), (8, 8, 128, 32), (14, 2, 64, 5), (4, 1, 64, 256), (20, 10, 32, 8)])
def test_paged_attention_equals_dense(heads, kv_heads, head_dim, block_size, dtype):
    """fp32, and a bf16 pool (the decode's in bf16: the CPU's bf16 dot products where it has them, q
    and the probabilities rounded to bf16 as torch's bf16 attention rounds them; else each element
    widened to fp32) against dense attention in fp32 over the same values."""
    if dtype == torch.bfloat16 and block_size % 2:
        block_size += 1         # a bf16 pool's blocks hold tokens in pairs (paired_kv): even sizes only
    assert kernels.attention_supported(heads, kv_heads, head_dim, block_size)
    g = torch.Generator().manual_seed(heads * 100 + block_size)
    layers, layer, num_blocks, seqs, max_blocks = 3, 1, 64, 5, 9
    # The layer-major pool of the runner: a block's stride spans its K and V of the layer; the kernel
    # reads it as stored (paired in bf16), dense attention token-major.
    pool = torch.randn(layers, num_blocks, 2, kv_heads, block_size, head_dim, generator=g).to(dtype)
    stored = pool.clone()
    stored[:, :, 0], stored[:, :, 1] = paired_kv.as_stored(pool[:, :, 0], True), paired_kv.as_stored(pool[:, :, 1], False)
    k_cache, v_cache = pool[layer, :, 0], pool[layer, :, 1]
    k_stored, v_stored = stored[layer, :, 0], stored[layer, :, 1]
    # Blocks scattered, and (the last two sequences) in runs of adjacent blocks, which the bf16 kernel
    # reads as one stream.
    tables = torch.randperm(num_blocks, generator=g)[:seqs * max_blocks].view(seqs, max_blocks).contiguous()
    tables[3:] = torch.arange(2 * max_blocks).view(2, max_blocks) + num_blocks - 2 * max_blocks
    # Lengths from one token to every block full, partial last blocks among them; rows may share a sequence.
    row_len = torch.tensor([1, block_size, block_size + 1, max_blocks * block_size, 3 * block_size - 2, 7])
    row_seq = torch.tensor([0, 1, 2, 3, 4, 3])
    q = torch.randn(len(row_len), heads, head_dim, generator=g) * 3
    scale = head_dim ** -0.5
    got = kernels.paged_attention(q, k_stored, v_stored, tables, row_seq, row_len, scale)
    exact = dense_attention(q, k_cache.float(), v_cache.float(), tables, row_seq, row_len, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-5)
    else:       # (outputs are averages of unit normals: bf16's 8 bits of mantissa allow ~1e-2; q is
                # rounded to bf16 too, which moves this test's scores of up to ~3 by up to ~1%)
        torch.testing.assert_close(got, exact, rtol=0, atol=3e-2)
    # row_seq None: row r is sequence r.
    first = kernels.paged_attention(q[:seqs], k_stored, v_stored, tables, None, row_len[:seqs], scale)
    torch.testing.assert_close(first, got[:seqs])
    # One row: its heads are split over tasks (fewer rows than threads). (Six rows: a task per row, whose
    # 10 KV heads, in the last shape, take two passes of HEADS_PER_PASS = 8 and 2.)
    for r in (0, 3):
        one = kernels.paged_attention(q[r:r + 1], k_stored, v_stored, tables, row_seq[r:r + 1], row_len[r:r + 1], scale)
        torch.testing.assert_close(one, got[r:r + 1])


def test_bf16_attention_never_reads_past_a_rows_length():
    """An odd length ends a bf16 block mid-pair: the pair's other slot (and every slot after it) may
    hold anything, NaN included, and must not reach the output."""
    heads, kv_heads, D, block_size, length = 6, 2, 64, 8, 13
    g = torch.Generator().manual_seed(4)
    pool = torch.randn(4, 1, 2, kv_heads, block_size, D, generator=g).to(torch.bfloat16)
    tables = torch.tensor([[2, 0]])
    pool[0, :, :, :, length - block_size:] = float("nan")          # block 0 is the row's second
    stored = torch.stack([paired_kv.as_stored(pool[:, :, 0], True), paired_kv.as_stored(pool[:, :, 1], False)], 2)
    q, scale = torch.randn(1, heads, D, generator=g), D ** -0.5
    got = kernels.paged_attention(q, stored[:, 0, 0], stored[:, 0, 1], tables, None, torch.tensor([length]), scale)
    exact = dense_attention(q, pool[:, 0, 0].float(), pool[:, 0, 1].float(), tables, [0], [length], scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got, exact, rtol=0, atol=3e-2)


def test_paired_layout_round_trips_and_stores_where_the_kernels_read():
    g = torch.Generator().manual_seed(6)
    blocks = torch.randn(5, 3, 8, 32, generator=g).to(torch.bfloat16)         # [blocks, kv_heads, bs, D]
    for keys in (True, False):
        stored = paired_kv.as_stored(blocks, keys)
        assert not torch.equal(stored, blocks) and torch.equal(paired_kv.token_major(stored, keys), blocks)
        # Storing token by token into an empty pool gives the same bytes.
        pool = torch.zeros(7, 2, 2, 3, 8, 32, dtype=torch.bfloat16)
        cache = pool[:, 1, 0 if keys else 1]
        slot_block = torch.arange(5).repeat_interleave(8) + 2
        slot_offset = torch.arange(8).repeat(5)
        paired_kv.store(cache, slot_block, slot_offset, blocks.transpose(1, 2).reshape(40, 3, 32), keys)
        assert torch.equal(cache[2:], stored) and pool[:, 0].abs().sum() == 0 and cache[:2].abs().sum() == 0
    fp32 = blocks.float()
    assert paired_kv.as_stored(fp32, True) is fp32                  # other dtypes stay token-major
    with pytest.raises(ValueError, match="even"):
        paired_kv.check_block_size(torch.bfloat16, 5)


def test_unsupported_shapes_are_refused():
    assert not kernels.attention_supported(9, 3, 80, 16)        # head_dim 80
    assert not kernels.attention_supported(18, 1, 64, 16)       # 18 query heads per KV head
    assert not kernels.attention_supported(9, 2, 64, 16)        # heads not a multiple of KV heads
    assert not kernels.attention_supported(9, 3, 64, 512)       # block longer than the kernel's buffer


def test_rms_norm_with_and_without_the_residual_add():
    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=g)
    x, delta = torch.randn(7, 96, generator=g) * 4, torch.randn(7, 96, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(kernels.rms_norm(x.clone(), norm.weight, norm.eps), norm(x))
        summed = x.clone()
        torch.testing.assert_close(kernels.rms_norm(summed, norm.weight, norm.eps, delta=delta), norm(x + delta))
    assert torch.equal(summed, x + delta)          # the residual sum stays in the caller's tensor


def test_rope_and_kv_store_equal_torch():
    cfg = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256)
    g = torch.Generator().manual_seed(9)
    T, heads, kv_heads, D, block_size = 11, 4, 2, 32, 8
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 200, 201, 17, 255])
    rope = Rotary(cfg, 256).table(positions, torch.float32)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, generator=g)
    pool = torch.zeros(40, 2, 2, kv_heads, block_size, D)
    slot_block, slot_offset = torch.randperm(40, generator=g)[:T], torch.randint(0, block_size, (T,), generator=g)
    expected_q = Rotary.rotate(qkv[:, :heads * D].view(T, heads, D), rope)
    expected_k = Rotary.rotate(qkv[:, heads * D:(heads + kv_heads) * D].view(T, kv_heads, D), rope)
    v = qkv[:, (heads + kv_heads) * D:].view(T, kv_heads, D).clone()
    kernels.rope_store_kv(qkv, heads, kv_heads, D, rope, pool[:, 1, 0], pool[:, 1, 1], slot_block, slot_offset)
    torch.testing.assert_close(qkv[:, :heads * D].view(T, heads, D), expected_q)
    torch.testing.assert_close(pool[slot_block, 1, 0, :, slot_offset], expected_k)
    assert torch.equal(pool[slot_block, 1, 1, :, slot_offset], v)
    assert pool[:, 0].abs().sum() == 0              # the other layer is untouched


@pytest.mark.parametrize("tied", [True, False])
def test_a_packed_model_gives_the_plain_models_logits(tied):
    cfg = ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=200, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=512, tie_word_embeddings=tied)
    torch.manual_seed(3)
    plain = LlamaModel(cfg).eval()
    packed = LlamaModel(cfg).eval()
    packed.load_state_dict(plain.state_dict())
    packed.use_cpu_kernels()
    assert packed.embed_tokens is None if tied else packed.embed_tokens is not None
    ids = torch.randint(0, cfg.vocab_size, (70,)).tolist()
    with torch.inference_mode():
        torch.testing.assert_close(prompt_logits(packed, ids), prompt_logits(plain, ids), rtol=1e-4, atol=1e-4)


def decode_step_logits(model: LlamaModel, prompts: list[list[int]], block_size: int) -> torch.Tensor:
    """Each prompt prefilled on its own (blocks handed out in a shuffled order), then one decode
    step for all of them at once (the next token of each is its prompt's first): its logits."""
    cfg = model.cfg
    need = [-(-(len(p) + 1) // block_size) for p in prompts]
    order = torch.randperm(sum(need) + 1, generator=torch.Generator().manual_seed(0)).tolist()
    runner = ModelRunner(model, sum(need) + 1, block_size)
    requests = []
    for i, prompt in enumerate(prompts):
        request = Request(f"r{i}", prompt, SamplingParams(max_tokens=2))
        request.block_table, order = order[:need[i]], order[need[i]:]
        runner.run([ScheduledChunk(request, len(prompt))])
        request.num_computed_tokens = len(prompt)
        request.output_token_ids.append(prompt[0] % cfg.vocab_size)
        requests.append(request)
    return runner.run([ScheduledChunk(r, 1) for r in requests])


def small_model(bias: bool, seed: int, intermediate: int = 200) -> LlamaModel:
    """Two layers, GQA (6 heads over 2), tied embeddings, with or without a random qkv bias (Qwen2)."""
    cfg = ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=intermediate, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=512, tie_word_embeddings=True, attention_bias=bias)
    torch.manual_seed(seed)
    model = LlamaModel(cfg).eval()
    if bias:
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.qkv_proj.bias.normal_()
    return model


@pytest.mark.parametrize("bias", [False, True])
def test_a_fused_decode_step_gives_the_plain_models_logits(bias):
    """decode_layer (one C call per layer) against the torch model: 5 sequences of lengths around
    the block edges in one decode step, GQA, with and without a qkv bias (Qwen2)."""
    plain = small_model(bias, seed=4)
    cfg = plain.cfg
    fused = LlamaModel(cfg).eval()
    fused.load_state_dict(plain.state_dict())
    fused.use_cpu_kernels()
    assert fused.fused_decode is not None
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (1, 15, 16, 17, 70)]
    torch.testing.assert_close(decode_step_logits(fused, prompts, 16), decode_step_logits(plain, prompts, 16),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 16, 20, 33, 130])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (41, 136), (8, 1536), (41, 576)])
def test_gemv_bf16_equals_f_linear_and_each_row_is_batch_invariant(rows, out_features, in_features):
    """A bf16 linear (gemm_bf16_vnni on packed weights with the CPU's bf16 dot products, else gemv_bf16
    widening torch's layout) sums in fp32: F.linear over the same (bf16) weights in fp32, to fp32
    rounding (of x rounded to bf16 where the dot products serve); a row's result is bit-for-bit the
    same whatever else is in the batch (2-32 rows: a decode batch's column tiles, 20 in two chunks; 33
    and 130: 4 x 4 tiles, 130 in more than one block of rows; 41 outputs: a panel partly padding)."""
    g = torch.Generator().manual_seed(rows * 11 + out_features)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g)
    y = kernels.linear_bf16(x, weight)
    seen = x.bfloat16().float() if kernels.native_bf16(in_features) else x
    torch.testing.assert_close(y, F.linear(seen, weight.float()), rtol=1e-5, atol=1e-4)
    alone = [kernels.linear_bf16(x[i:i + 1], weight) for i in range(rows)]
    assert torch.equal(y, torch.cat(alone)) if rows else y.shape == (0, out_features)   # (a step sampling nothing)


def test_a_bf16_linear_row_does_not_depend_on_the_thread_count():
    """Workers of one fleet may run different thread counts: a row's sums must not change with them."""
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(300, 576, generator=g).bfloat16(), torch.randn(7, 576, generator=g)
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(kernels.linear_bf16(x, weight))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(results[0], other) for other in results[1:])


def test_weights_packed_together_equal_each_packed_alone_in_read_order_on_aligned_memory():
    """pack_vnni_together: the same packed bytes as pack_vnni of each, back to back in the order given,
    in one region that starts on a huge page (so the kernel can back it with 2 MiB pages), zeroed."""
    if not kernels.native_bf16(576):
        pytest.skip("no bf16 dot products on this CPU: nothing is packed for them")
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(n, k, generator=g).bfloat16() for n, k in ((960, 576), (41, 136), (576, 1536))]
    together = kernels.pack_vnni_together(weights)
    assert all(torch.equal(packed, kernels.pack_vnni(w)) for packed, w in zip(together, weights))
    assert together[0].data_ptr() % kernels.HUGE_PAGE == 0
    for before, after in zip(together, together[1:]):
        assert after.data_ptr() == before.data_ptr() + before.numel() * 2
    fresh = kernels.streamed_memory(3 * kernels.HUGE_PAGE + 5, torch.float32)
    assert fresh.data_ptr() % kernels.HUGE_PAGE == 0 and not fresh.any()


def test_fp32_weights_placed_together_keep_their_values_in_read_order():
    """place_together: each PackedLinear's panels, unchanged, back to back in one region that starts on
    a huge page; the linear computes what it did."""
    g = torch.Generator().manual_seed(6)
    linears = [kernels.PackedLinear(torch.randn(n, k, generator=g), None) for n, k in ((960, 576), (41, 136))]
    x = torch.randn(3, 576, generator=g)
    before, y = [l.panels.clone() for l in linears], linears[0](x)
    kernels.place_together(linears)
    assert all(torch.equal(l.panels, b) for l, b in zip(linears, before))
    assert linears[0].panels.data_ptr() % kernels.HUGE_PAGE == 0
    assert linears[1].panels.data_ptr() == linears[0].panels.data_ptr() + linears[0].panels.numel() * 4
    assert torch.equal(linears[0](x), y) and dict(linears[0].named_buffers())["panels"] is linears[0].panels


@pytest.mark.parametrize("bias,intermediate", [(False, 200), (True, 200), (False, 256)])
@pytest.mark.parametrize("batch", [(1, 15, 16, 17, 70), (33,), tuple(range(20, 60))])
def test_a_bf16_fused_decode_step_gives_the_reference_logits(bias, intermediate, batch):
    """bf16 weights and a bf16 K/V pool: decode_layer (fp32 activations, each matmul's input rounded to
    bf16 where the CPU's bf16 dot products serve, weights widened on load elsewhere) against the torch
    model on the same bf16 weights in fp32 (the same maths but for those roundings); torch's own bf16
    path, which rounds every activation to bf16, is farther from it. An intermediate width of whole
    panels (256) has its gate and up panels interleaved and SiLU computed pair by pair, in column tiles
    (2-32 rows) and in row tiles (one row, 40); 200 keeps gate_up on the widening path."""
    plain = small_model(bias, seed=5, intermediate=intermediate).bfloat16()
    cfg = plain.cfg
    fused = LlamaModel(cfg).eval().bfloat16()
    fused.load_state_dict(plain.state_dict())
    fused.use_cpu_kernels()
    assert fused.fused_decode is not None and fused.packed_head is None
    gate_up = fused.fused_decode.layers[0].gate_up
    assert (id(gate_up) in fused.fused_decode.vnni) == (intermediate % 16 == 0 and kernels.native_bf16(cfg.hidden_size))
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in batch]
    got = decode_step_logits(fused, prompts, 16)
    assert got.dtype == torch.float32
    widened = LlamaModel(cfg).eval()
    widened.load_state_dict({k: v.float() for k, v in plain.state_dict().items()})
    exact = decode_step_logits(widened, prompts, 16)
    assert (got - exact).abs().max() < 1e-3 * exact.abs().max()      # (the K/V's rounding to bf16)
    assert (got - exact).abs().max() < (decode_step_logits(plain, prompts, 16).float() - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_in_c_equal_torchs_and_refuse_ids_outside_the_vocabulary(dtype):
    """kernels.embed_rows (a decode step's token rows, widened to fp32 in one call) against
    torch's embedding, repeated and unordered ids included; an id outside the table is an IndexError,
    not a read beyond it."""
    g = torch.Generator().manual_seed(8)
    table = torch.randn(300, 136, generator=g).to(dtype)
    ids = torch.tensor([5, 0, 299, 5, 17])
    assert torch.equal(kernels.embed_rows(table, ids), F.embedding(ids, table).float())
    assert kernels.embed_rows(table, ids[:0]).shape == (0, 136)
    for bad in (300, -1):
        with pytest.raises(IndexError, match=f"token id {bad} is out of range for a vocabulary of 300"):
            kernels.embed_rows(table, torch.tensor([3, bad]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_row_beyond_ropes_table_is_an_error_not_a_read_past_it(dtype):
    """FusedDecode looks RoPE's angles up by position in C: a position outside the table (a model
    built for fewer positions than a request reached) raises before any layer runs."""
    plain = small_model(False, seed=6).to(dtype)
    cfg = plain.cfg
    fused = LlamaModel(cfg, max_positions=20).eval().to(dtype)
    fused.load_state_dict(plain.state_dict())
    fused.use_cpu_kernels()
    assert fused.fused_decode is not None
    with pytest.raises(IndexError, match="position 20 is beyond RoPE's table of 20"):
        decode_step_logits(fused, [[1, 2, 3], list(range(20))], 16)


def last_token_logits(model: LlamaModel, prompt: list[int], chunks: list[int], beside: list[int] | None = None,
                      block_size: int = 16) -> torch.Tensor:
    """`prompt` computed in steps of `chunks` tokens (a step of one token is a decode row), with
    `beside` prefilled in the first step too: the logits of the prompt's last token."""
    need = -(-len(prompt) // block_size)
    runner = ModelRunner(model, 2 * need + 8, block_size)
    request = Request("a", prompt, SamplingParams(max_tokens=2))
    request.block_table = list(range(need))
    step = []
    if beside is not None:
        other = Request("b", beside, SamplingParams(max_tokens=2))
        other.block_table = list(range(need, need + -(-len(beside) // block_size)))
        step = [ScheduledChunk(other, len(beside))]
    for n in chunks:
        logits = runner.run([ScheduledChunk(request, n)] + step)
        request.num_computed_tokens += n
        step = []
    return logits[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_logits_do_not_depend_on_how_its_prompt_was_computed(dtype):
    """Row-wise prefill (issue 25): a prompt token goes through the decode kernels as a row whose
    context ends at its own position, so its logits are bit for bit the same prefilled whole, in
    chunks, beside another prompt, or decoded on its own (a preempted request recomputes as a prefill
    what it had decoded). Torch's bf16 prefill, with bf16 activations between ops, gave other bits."""
    cfg = ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(6)
    model = LlamaModel(cfg).eval().to(dtype)
    model.use_cpu_kernels()
    if dtype == torch.bfloat16 and not kernels.native_bf16(cfg.hidden_size):
        pytest.skip("no bf16 dot products on this CPU: bf16 prompts stay on torch (the widening kernels are slower)")
    assert model.row_wise_prefill
    g = torch.Generator().manual_seed(6)
    prompt, other = (torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (70, 45))
    whole = last_token_logits(model, prompt, [70])
    assert torch.equal(whole, last_token_logits(model, prompt, [23, 30, 17]))
    assert torch.equal(whole, last_token_logits(model, prompt, [70], beside=other))
    assert torch.equal(whole, last_token_logits(model, prompt, [69, 1]))
    assert torch.equal(whole, last_token_logits(model, prompt, [40, 1, 1, 28]))


def test_without_gcc_the_engine_falls_back_to_torch(tmp_path):
    """No compiler on PATH: the engine says so and serves the same greedy tokens through torch."""
    script = (
        "from kvhandoff.config import EngineConfig\n"
        "from kvhandoff.engine.engine import LLMEngine\n"
        "from kvhandoff.engine.request import SamplingParams\n"
        "e = LLMEngine(EngineConfig(model='tiny', dtype='float32'))\n"
        "print(e.kernels)\n"
        "print(e.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0])\n")
    env = {**os.environ, "PATH": str(tmp_path)}     # an empty folder: no gcc
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    status, tokens = out.stdout.strip().splitlines()[-2:]
    assert status == "off (no gcc to build them)"
    env[kernels.DISABLE_ENV] = "1"
    env["PATH"] = os.environ["PATH"]
    with_kernels = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert with_kernels.returncode == 0, with_kernels.stderr[-2000:]
    assert with_kernels.stdout.strip().splitlines()[-2:] == [f"{kernels.status()}: fp32, prompts row by row like decode rows", tokens]


def test_the_core_handoff_probe_times_a_line_between_two_threads():
    """The limit probe's cross-core latency (kernels.core_handoff_ns): two OpenMP threads hand a flag
    back and forth; on two cores that is tens to hundreds of ns one way (more when the threads share
    a busy core, but never nothing)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: nothing to hand a line to")
    ns = kernels.core_handoff_ns(500)
    assert ns is not None and 1 < ns < 5e6
