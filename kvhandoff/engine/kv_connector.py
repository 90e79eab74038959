"""The fixed points at which the engine calls a KV connector (the worker's handoff, kvhandoff.worker.connector), in the
spirit of vLLM's connector split: a scheduler half that does no I/O, and a worker half that posts
transfers and polls for the finished ones, once per step. The engine knows nothing of transfers.

Per step, in order (LLMEngine.step):
1. `poll()`: transfers that finished since the last step: K/V that landed (or will not come), and
   held blocks that may go back to the pool. Applied before scheduling, so a request whose K/V
   just landed decodes in this very step.
2. scheduling; its remote-KV section reserves blocks for requests whose first `remote_tokens`
   come from elsewhere and calls `reserved(request, num_local_tokens)` for each (no I/O).
3. `start_loads()`: the worker half posts what `reserved` recorded (a READ, a registration).
4. the forward pass, calling what `layer_hook(chunks)` returned (if anything) after each layer.
5. `finished(request, out)` for every request that ended: True keeps its blocks (the connector then
   owns them, as Hold.PINNED under the request id, until it releases them through poll()).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kvhandoff.engine.request import Request, RequestOutput
    from kvhandoff.engine.scheduler import ScheduledChunk


@dataclass
class Landed:
    """The K/V of a WAITING_FOR_KV request is in its blocks, verified."""
    request_id: str
    first_token: int | None = None      # with a whole prompt's K/V: the token the prefill sampled


@dataclass
class Lost:
    """The K/V of a WAITING_REMOTE or WAITING_FOR_KV request will not come: recompute or fail."""
    request_id: str
    recompute: bool
    reason: str
    settled: bool = True        # False: a transfer may still write into its blocks (set them aside)


@dataclass
class KVEvents:
    landed: list[Landed] = field(default_factory=list)
    lost: list[Lost] = field(default_factory=list)
    release: list[str] = field(default_factory=list)    # owners of held blocks (holds.py) to free

    def __bool__(self) -> bool:
        return bool(self.landed or self.lost or self.release)


class KVConnector:
    """The default connects nothing: every request is computed here, nothing is held for anyone."""

    # ---- scheduler half: bookkeeping only, never I/O -------------------------------------------
    def reserved(self, request: "Request", num_local_tokens: int) -> None:
        """Blocks are reserved for a remote-KV request (WAITING_FOR_KV); the K/V of its first
        `num_local_tokens` was found in this engine's prefix cache and need not travel."""
        raise AssertionError(f"{request.request_id} expects remote K/V, but no connector delivers it")

    def finished(self, request: "Request", out: "RequestOutput") -> bool:
        """`request` ended (out is its final output, which the connector may annotate): keep its
        blocks for a handoff?"""
        return False

    # ---- worker half: posts and polls, never waits ----------------------------------------------
    def start_loads(self) -> None:
        """Post the transfers the reservations of this step need."""

    def layer_hook(self, chunks: list["ScheduledChunk"]) -> Callable[[int], None] | None:
        """Before this step's forward pass: what to call with each layer once that layer of the
        step's chunks is computed (None: nothing, and the forward pass makes no call per layer)."""
        return None

    def poll(self) -> KVEvents:
        return KVEvents()

    def has_events(self) -> bool:
        """Would poll() return anything? (The engine loop sleeps only when not.)"""
        return False
