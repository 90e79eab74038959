"""Convert a llama.cpp GGUF file (llama architecture) into a Hugging Face-style model folder.

The folder (config.json, model.safetensors in float32, tokenizer.json, tokenizer_config.json) is
what the loader reads for every model, so one forward implementation serves both formats. Weights are
dequantized once here (any type `gguf.quants` knows: Q4_0/1, Q8_0, K-quants, F16, BF16...), and
llama.cpp's Q/K row permutation is undone so the weights use Hugging Face's rotate-half RoPE layout.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

import gguf
from kvhandoff.config import ModelConfig

# Bump when the output of convert_gguf changes, so cached conversions are redone.
CONVERTER_VERSION = "1"

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> how the original HF tokenizer splits text.
# StarCoder-family vocabularies (SmolLM among them) isolate every digit before the GPT-2 regex; their
# merges were learned that way, so splitting otherwise changes ids (e.g. "a  1").
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_GPT2 = {"default", "gpt-2", "gpt2", "olmo", "jais", "phi-2", "stablelm2", "mpt", "gpt3-finnish"}
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_REGEX_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                 "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                 "deepseek-r1-qwen": _QWEN2_SPLIT}

TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


class GGUFMeta:
    """Typed access to a GGUF file's key-value metadata."""

    def __init__(self, reader: gguf.GGUFReader):
        self.fields = reader.fields
        self.arch = self.get("general.architecture")

    def get(self, key: str, default=None):
        key = key.replace("{arch}", getattr(self, "arch", "") or "")
        field = self.fields.get(key)
        return default if field is None else field.contents()


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's permute(): llama.cpp interleaves each head's rotary halves.

    permute(w) = w.reshape(n_head, 2, d//n_head//2, *rest).swapaxes(1, 2).reshape(w.shape), so the
    inverse reshapes to (n_head, d//n_head//2, 2, *rest) and swaps back. Use n_head for q, n_kv_head for k.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (HF -> GGUF layout); here for round-trip tests."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(x: float) -> float:
    # GGUF stores these as float32: take the shortest decimal that rounds to it (1e-05, not 9.9999997e-06).
    return float(str(np.float32(x)))


def read_config(meta: GGUFMeta, tensor_names: set[str]) -> ModelConfig:
    if meta.arch != "llama":
        raise ValueError(f"GGUF architecture {meta.arch!r} is not supported (only 'llama')")
    n_head = meta.get("{arch}.attention.head_count")
    hidden = meta.get("{arch}.embedding_length")
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style scaling is stored as precomputed factors; mapping them back is not implemented.
        raise ValueError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported")
    rope_scaling = None
    if meta.get("{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta.get("{arch}.rope.scaling.factor"))}
    eos = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return ModelConfig(
        vocab_size=meta.get("{arch}.vocab_size") or len(tokens),
        hidden_size=hidden,
        intermediate_size=meta.get("{arch}.feed_forward_length"),
        num_layers=meta.get("{arch}.block_count"),
        num_heads=n_head,
        num_kv_heads=meta.get("{arch}.attention.head_count_kv") or n_head,
        head_dim=meta.get("{arch}.attention.key_length") or meta.get("{arch}.rope.dimension_count")
        or hidden // n_head,
        rms_norm_eps=_f32(meta.get("{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(meta.get("{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=meta.get("{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(i for i in eos if i is not None)),
    )


def read_tensors(reader: gguf.GGUFReader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for t in reader.tensors:
        layer, rest = t.name.split(".", 2)[1:] if t.name.startswith("blk.") else (None, t.name)
        if layer is not None and rest in _LAYER_NAMES:
            name = f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
        elif layer is None and rest in _TOP_NAMES:
            name = _TOP_NAMES[rest]
        else:
            raise ValueError(f"unexpected GGUF tensor {t.name!r}")
        # GGUF lists dims fastest-first (ne0 = columns); numpy/torch want rows first.
        shape = tuple(int(d) for d in reversed(t.shape))
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if rest == "attn_q.weight":
            w = unpermute_qk(w, cfg.num_heads)
        elif rest == "attn_k.weight":
            w = unpermute_qk(w, cfg.num_kv_heads)
        out[name] = torch.from_numpy(np.require(w, requirements=["C", "W"]))   # F32 tensors are read-only mmaps
    return out


def build_tokenizer(meta: GGUFMeta) -> Tokenizer:
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _GPT2:
        tok.pre_tokenizer = byte_level
    elif pre in _REGEX_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        # A wrong split silently changes token ids; refuse rather than guess.
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B:1",
            special_tokens=[(tokens[bos], bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|>...) must be matched whole in text and hidden when decoding.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED])
    return tok


def tokenizer_config(meta: GGUFMeta, cfg: ModelConfig) -> dict:
    tokens = meta.get("tokenizer.ggml.tokens")
    name = lambda key: None if meta.get(key) is None else tokens[meta.get(key)]   # noqa: E731
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
    }


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the HF-style folder for `gguf_path` into `out_dir` (created; existing files overwritten)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(gguf_path))
    meta = GGUFMeta(reader)
    cfg = read_config(meta, {t.name for t in reader.tensors})
    tensors = read_tensors(reader, cfg)
    expected = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
                "model.layers.0.self_attn.q_proj.weight": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
                "model.layers.0.self_attn.k_proj.weight": (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
                "model.layers.0.mlp.down_proj.weight": (cfg.hidden_size, cfg.intermediate_size)}
    for name, shape in expected.items():
        assert tuple(tensors[name].shape) == shape, f"{name}: shape {tuple(tensors[name].shape)} != {shape}"
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf() | {"torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta, cfg), indent=2, sort_keys=True))
    return out
