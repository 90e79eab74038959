"""Text <-> token ids for a model folder: the `tokenizers` library plus the folder's chat template.

Reads the Hugging Face layout (tokenizer.json, tokenizer_config.json, optionally chat_template.jinja,
config.json / generation_config.json for extra stop ids) so that prompts are tokenized and chats are
rendered exactly as `transformers` would, without importing it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer


def _token_str(value) -> str | None:
    # tokenizer_config.json spells special tokens either as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; transformers overrides it with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (sandboxed; trim/lstrip blocks; loop controls)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# Decoders after which a run of tokens, decoded behind at least one token of context, gives that run's
# text in place: byte-level BPE's (GPT-2, Llama 3, SmolLM2: invalid bytes replaced one run at a time,
# as UTF-8 resynchronizes), and "▁" to a space with the text's first space stripped (which the
# context absorbs). Others are decoded whole (engine/detokenizer.py): WordPiece's cleanup joins across
# tokens, and ByteFallback replaces every byte of a run of byte tokens once the run is invalid, so a
# byte can change the text before it (E2 82 82 is "₂"; one more E2 makes it four replacements).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                   "generation_config.json")
_WINDOWED_DECODERS = {"ByteLevel", "Fuse", "Replace", "Strip", "Metaspace"}


@dataclass
class Tokenizer:
    tok: HFTokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    extra_eos_ids: list[int] = field(default_factory=list)   # from config.json / generation_config.json

    files: dict[str, str] = field(default_factory=dict)     # what it was made from (routers fetch them)

    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        return cls.from_files({name: (path / name).read_text(encoding="utf-8") for name in TOKENIZER_FILES
                               if (path / name).exists()})

    @classmethod
    def from_files(cls, files: dict[str, str]) -> "Tokenizer":
        """From the texts of a model folder's TOKENIZER_FILES (tokenizer.json required)."""
        def read(name: str) -> dict:
            return json.loads(files[name]) if name in files else {}
        tok = HFTokenizer.from_str(files["tokenizer.json"])
        cfg = read("tokenizer_config.json")
        # Tokens declared only in tokenizer_config.json (older checkpoints) must still be matched whole.
        for spec in cfg.get("added_tokens_decoder", {}).values():
            if tok.token_to_id(spec["content"]) is None:
                added = AddedToken(spec["content"], special=spec.get("special", False),
                                   normalized=spec.get("normalized", False),
                                   lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False))
                (tok.add_special_tokens if added.special else tok.add_tokens)([added])
        template = cfg.get("chat_template")
        if isinstance(template, list):      # named templates: [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None:
            template = files.get("chat_template.jinja")
        # Models often stop on more than the tokenizer's eos (Llama 3: <|eot_id|>); the model config says which.
        extra = _ids(read("config.json").get("eos_token_id")) + _ids(read("generation_config.json").get("eos_token_id"))
        return cls(tok, template, _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")), extra, files)

    @cached_property
    def fingerprint(self) -> str:
        """Equal for tokenizers made from the same files: a router fetches each one once."""
        return hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()[:16]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def decodes_in_windows(self) -> bool:
        """May an output be decoded a few tokens at a time (see _WINDOWED_DECODERS)? Asked on a first
        token's path: the decoder's own JSON (its pickled state, ~10 us), not the whole tokenizer's
        (to_str: ~50 ms for SmolLM2's)."""
        decoder = self.tok.decoder
        spec = None if decoder is None else json.loads(decoder.__getstate__())
        steps = spec.get("decoders", []) if spec and spec.get("type") == "Sequence" else [spec]
        return bool(steps) and all(step and step.get("type") in _WINDOWED_DECODERS for step in steps)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no 'chat_template' "
                             "and there is no chat_template.jinja); send a plain prompt instead of messages")
        return compile_chat_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render a conversation to the prompt string (special tokens as text; encode it without adding more)."""
        variables = {"tools": None, "documents": None, "bos_token": self.bos_token or "",
                     "eos_token": self.eos_token or "", **kwargs}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.tok.token_to_id(self.bos_token)

    @cached_property
    def eos_token_ids(self) -> list[int]:
        ids = [] if self.eos_token is None else [self.tok.token_to_id(self.eos_token)]
        return list(dict.fromkeys(i for i in ids + self.extra_eos_ids if i is not None))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> list[int]:
        special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        special |= {i for i in [self.bos_token_id, *self.eos_token_ids] if i is not None}
        return sorted(special)
