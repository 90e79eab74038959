"""A seeded random tiny Llama, written as a Hugging Face folder: the model every test can run offline.

Small enough to run anywhere in milliseconds, yet it exercises every code path of a real checkpoint:
GQA, untied lm_head, non-trivial norm weights, a byte-level BPE tokenizer (trained here, on the text
below, by a deterministic pure-Python BPE), and a ChatML chat template. Weights are scaled so that
greedy decoding wanders over many tokens instead of repeating one (so "output A == output B" tests
mean something), and the special tokens' lm_head rows are zero so generations run to max_tokens.
Bit-identical files for a given seed.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from kvhandoff.config import ModelConfig

# Bump whenever the output of build_tiny changes: it is part of the loader's cache key.
TINY_VERSION = "1"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MAX_VOCAB = 640                 # the corpus runs out of pairs seen twice first: 573 tokens
CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model reads a prompt, one token at a time,
and writes an answer one token at a time. Serving such a model well is a matter of memory and time.
When a request arrives, the server first runs the prefill: every token of the prompt goes through the
model at once, and the keys and values of each attention layer are written into a cache. Then comes the
decode phase, which produces one new token per step for each running sequence. Prefill is limited by
compute; decode is limited by memory bandwidth. Putting both on the same machine means each one slows
the other down, so many systems now split them: a prefill worker computes the cache, hands it over, and
a decode worker continues from there. The handoff must be fast, it must be correct, and it must never
leak memory, even when a worker crashes or a network link fails halfway through a transfer.

Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy. Madrid
is the capital of Spain. London is the capital of the United Kingdom. The river Seine flows through
Paris, and the Thames flows through London. In spring the parks are green and the cafes are full of
people who talk, read, and watch the world go by. Travellers take the train from one city to another,
and the journey is often shorter than the wait at the airport.

Once upon a time there was a little robot who wanted to learn how to cook. Every morning it watched the
baker next door mix flour, water, salt and yeast. The robot measured everything twice and wrote it all
down in a small notebook. On the first day the bread was flat. On the second day it was burnt. On the
third day the robot waited, listened to the oven, and smelled the air, and the bread came out golden
and warm. The baker smiled and said that good bread needs patience more than precision.

Numbers matter too: one, two, three, four, five, six, seven, eight, nine, ten. There are 60 seconds in
a minute, 60 minutes in an hour, 24 hours in a day, and 365 days in most years. A block holds 32 tokens;
a model with 30 layers and 3 key-value heads of size 64 stores 2 * 30 * 3 * 64 values for every token.
If the prompt has 1000 tokens, the prefill writes 32 blocks, and the last one is only partly full.

Good software is simple to read. Each function does one thing, each name says what it means, and each
comment explains why, not what. Tests check behaviour that users care about: the same prompt gives the
same answer, errors are clear, and resources are always returned. When something goes wrong, the
system says so plainly instead of returning garbage. Small steps, measured often, beat large leaps
taken blindly. Write the simplest thing that works, measure it, and only then make it faster.

The weather today is mild, with a light wind from the west and a chance of rain in the evening.
Farmers watch the sky, sailors watch the sea, and children watch the clock until school is over.
Music drifts from an open window: a piano, a violin, and someone singing softly in another room.
Questions are welcome. What is the time? Where is the station? How far is it to the next village?
Why is the sky blue? Because air scatters blue light more than red light, the sky looks blue by day.
"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ByteLevel pre-tokenization produces)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train_bpe(text: str, vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE merges, learned greedily; ties broken by the pair itself so the result is
    deterministic (tokenizers' own trainer iterates hash maps, so its ties depend on the process)."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(w for w, _ in pre.pre_tokenize_str(text))
    splits = {w: tuple(w) for w in words}
    vocab = SPECIAL_TOKENS + [bytes_to_unicode()[b] for b in range(256)]
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        pairs: Counter = Counter()
        for w, count in words.items():
            s = splits[w]
            for pair in zip(s, s[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        vocab.append(best[0] + best[1])
        for w, s in splits.items():
            if len(s) > 1:
                splits[w] = _merge(s, best)
    return {t: i for i, t in enumerate(vocab)}, merges


def _merge(s: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(s):
        if i + 1 < len(s) and (s[i], s[i + 1]) == pair:
            out.append(s[i] + s[i + 1])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return tuple(out)


def build_tokenizer() -> Tokenizer:
    vocab, merges = train_bpe(CORPUS, MAX_VOCAB)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tiny_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=4096, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_ids=[SPECIAL_TOKENS.index("<|im_end|>"),
                                                         SPECIAL_TOKENS.index("<|endoftext|>")])


def tiny_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names, drawn in a fixed order from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def randn(*shape, std):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * std).contiguous()

    def norm():
        # Not all ones: a loader that drops a norm weight must change the logits.
        return 1.0 + randn(h, std=0.2)

    # The usual std 0.02 makes every position predict the same token. Unit-variance projections keep
    # each layer's contribution comparable to the embedding, so the context (via attention) decides.
    out = {"model.embed_tokens.weight": randn(cfg.vocab_size, h, std=1.0)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm()
        out[p + "self_attn.q_proj.weight"] = randn(q, h, std=2.0 / math.sqrt(h))
        out[p + "self_attn.k_proj.weight"] = randn(kv, h, std=2.0 / math.sqrt(h))
        out[p + "self_attn.v_proj.weight"] = randn(kv, h, std=1.0 / math.sqrt(h))
        out[p + "self_attn.o_proj.weight"] = randn(h, q, std=1.0 / math.sqrt(q))
        out[p + "post_attention_layernorm.weight"] = norm()
        out[p + "mlp.gate_proj.weight"] = randn(inter, h, std=1.0 / math.sqrt(h))
        out[p + "mlp.up_proj.weight"] = randn(inter, h, std=1.0 / math.sqrt(h))
        out[p + "mlp.down_proj.weight"] = randn(h, inter, std=1.0 / math.sqrt(inter))
    out["model.norm.weight"] = norm()
    lm_head = randn(cfg.vocab_size, h, std=3.0 / math.sqrt(h))
    # Special tokens' logits are exactly 0 while the maximum of the others is almost surely > 0:
    # greedy never stops early and never emits <|im_start|>.
    lm_head[: len(SPECIAL_TOKENS)] = 0.0
    out["lm_head.weight"] = lm_head
    return out


def build_tiny(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny model's HF folder (config.json, model.safetensors, tokenizer files) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    cfg = tiny_config(tok.get_vocab_size(with_added_tokens=True))
    save_file(tiny_weights(cfg, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf() | {"torch_dtype": "float32", "kvhandoff_tiny": {"version": TINY_VERSION, "seed": seed}}
    (folder / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    tok.save(str(folder / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "bos_token": None,
               "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
               "add_bos_token": False, "clean_up_tokenization_spaces": False,
               "model_max_length": cfg.max_position_embeddings}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True))
    return folder
