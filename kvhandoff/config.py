"""Configuration shared by every layer: the model's shape and the engine's knobs.

A leaf module (imports nothing from kvhandoff), so every layer may import it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


class ModelNotFound(ValueError):
    """The model named cannot be found or installed as asked: a user's error, said in one line."""


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None          # HF-style dict; "llama3" type supported
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False              # Qwen2: bias on q/k/v projections
    qk_norm: bool = False                     # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict."""
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        model_type = hf.get("model_type", "llama")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=hf.get("rope_theta", 10000.0),
            rope_scaling=hf.get("rope_scaling"),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            # Qwen2 always has qkv bias; Llama exposes it as attention_bias.
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> dict:
        """A Hugging Face config.json dict (architecture chosen from the variant flags)."""
        model_type = "qwen3" if self.qk_norm else ("qwen2" if self.attention_bias else "llama")
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        hf = {
            "architectures": [arch[model_type]], "model_type": model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
        }
        if model_type == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        return hf

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


# Block size: 32 tokens. The KV pool is layer-major (a layer's blocks side by side: llama.py), so a
# block is a transfer descriptor per layer, and a layer's adjacent blocks coalesce into one. For SmolLM2
# in bf16 a 32-token block is 720 KiB whole and 24 KiB per layer: large enough that a scattered block's
# pieces are not tiny (layer-wise push sends >= 16 KiB pieces), small enough that the last,
# partly-filled block and prefix-cache granularity waste little.
DEFAULT_BLOCK_SIZE = 32


@dataclass
class EngineConfig:
    model: str = "smollm2"                    # alias (smollm2, tiny) or a path (HF folder or .gguf)
    dtype: str = "auto"                       # auto | float32 | bfloat16 | float16
    device: str = "auto"                      # auto | cpu | cuda
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = 0                       # 0: derive from kv_cache_bytes
    kv_cache_bytes: int = 512 * 2**20         # KV pool size when num_blocks is 0
    max_num_seqs: int = 32                    # running sequences per step
    max_num_batched_tokens: int = 512         # per-step token budget (chunked prefill)
    max_model_len: int = 0                    # 0: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    threads: int = 0                          # torch intra-op threads; 0: leave as is
    cpu_kernels: bool = True                  # fp32 on CPU: kvhandoff.model.kernels when they build
    seed: int = 0

    def __post_init__(self):
        assert self.block_size > 0 and self.max_num_seqs > 0 and self.max_num_batched_tokens > 0
        if self.threads == 0 and os.environ.get("KVHANDOFF_THREADS"):
            self.threads = int(os.environ["KVHANDOFF_THREADS"])
