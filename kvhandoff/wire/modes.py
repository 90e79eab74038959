"""The handoff modes, defined once: what the CLI offers, the router sequences, the launcher starts,
the benchmarks compare and the workers implement (docs/HANDOFF.md, one section each); and the
other choices every process names the same way: a worker's role, its failure policy, the router's
policies.

It imports nothing of ours and nothing heavy: the CLI and the benchmarks import it without loading
torch, and it is the one module of wire/ that the layers below may name too (the engine's requests end
with a FinishReason, which the worker answers and the router reads).
"""
from __future__ import annotations

from enum import Enum, StrEnum


class Mode(str, Enum):
    PULL = "pull"                       # prefill pins, decode (chosen late) READs from its engine loop
    PULL_READER = "pull-reader"         # ... READs posted from a background reader thread
    PUSH = "push"                       # decode (chosen early) registers, prefill WRITEs
    PUSH_LAYERWISE = "push-layerwise"   # ... each layer of each chunk as soon as it is computed

    def __str__(self) -> str:
        return self.value

    @property
    def is_pull(self) -> bool:
        """Late binding: the decode worker is picked after the prefill, and READs the KV."""
        return self in (Mode.PULL, Mode.PULL_READER)

    @property
    def is_push(self) -> bool:
        """Early binding: the decode worker is picked at arrival, and the prefill WRITEs into it."""
        return not self.is_pull

    @property
    def reader_thread(self) -> bool:
        return self is Mode.PULL_READER

    @property
    def layerwise(self) -> bool:
        return self is Mode.PUSH_LAYERWISE

    @classmethod
    def parse(cls, value: str) -> "Mode":
        """A mode from its name; ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown handoff mode {value!r}; one of {', '.join(NAMES)}") from None


NAMES = tuple(m.value for m in Mode)
COLOCATED = "colocated"                 # no handoff: one worker serves the request whole
STACK_MODES = (COLOCATED, *NAMES)       # what `kvhandoff up` and the benchmarks can start


class FinishReason(StrEnum):
    """Why a request ended: the engine sets it, the worker answers it as OpenAI's `finish_reason`, the
    router reads it (also in a vLLM worker's answers, which use the same words)."""
    STOP = "stop"               # eos, stop token or stop string
    PREFILLED = "prefilled"     # prefill-only request: its KV is computed and pinned for a handoff
    LENGTH = "length"           # max_tokens or the context limit
    ABORT = "abort"             # cancelled (client gone, shutdown)
    ERROR = "error"             # the engine could not complete it


class Role(StrEnum):
    """A worker's side of the handoff (`kvhandoff serve --role`)."""
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"               # colocated: it serves requests whole and takes no handoff


ROLES = (Role.PREFILL, Role.DECODE)     # the roles of a disaggregated fleet: a router's two pools


class Engine(StrEnum):
    """The kind of worker a router drives (`--engine`): ours, or vLLM OpenAI servers with a NIXL
    connector (router/vllm.py; wire/vllm.py)."""
    KVHANDOFF = "kvhandoff"
    VLLM = "vllm"


# The handoff modes a vLLM 0.32 fleet has: its NixlConnector (pull) and NixlPushConnector (push).
VLLM_MODES = (Mode.PULL.value, Mode.PUSH.value)


class FailurePolicy(StrEnum):
    """What a decode worker does when a request's KV cannot be loaded (`--kv-load-failure-policy`)."""
    RECOMPUTE = "recompute"     # compute the prompt itself: slower, never wrong
    FAIL = "fail"               # end the request with an error


class DecodePolicy(str, Enum):
    """How the router ranks decode workers (`--decode-policy`; router/policies.py)."""
    ROUND_ROBIN = "round-robin"
    FEWEST = "fewest-in-flight"
    LOAD = "load"


class PrefillPolicy(str, Enum):
    """How the router ranks prefill workers (`--prefill-policy`)."""
    FEWEST = "fewest-in-flight"
    CACHE = "cache-aware"
