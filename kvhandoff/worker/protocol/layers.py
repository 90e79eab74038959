"""Layer-wise push's plan (worker/layerwise.py drives it): as each group of layers of each prefill
chunk is computed, which (blocks, layers) a WRITE may carry now. Each (block, layer) range is
written exactly once, when it is final, so writes never overlap and their order does not matter:

- a chunk writes the blocks it completes: a block it only starts (the prompt goes on past the
  chunk) waits for the chunk that completes it;
- blocks not written yet (those computed before a late registration; over shared memory, a chunk's
  too few to be worth a WRITE) go with the next chunk's layers;
- a prompt whose last chunk would go in one WRITE anyway leaves it to push's final WRITE, which
  covers whatever is left and carries Done.

A WRITE costs ~0.2 ms of the prefill's own core whatever its size, so a chunk's layers go in
groups (LAYER_WRITES_PER_CHUNK a chunk) of at least MIN_WRITE_BYTES.
"""
from __future__ import annotations

import msgspec

LAYER_WRITES_PER_CHUNK = 6      # SmolLM2's 30 layers: 5 at a time
# ... but no write under this many bytes: a WRITE costs ~0.2 ms of the prefill's core whatever its size
# (descriptors, the writer thread taking the GIL from the engine's), about what copying 1 MiB through
# shared memory takes. Measured (bench.disagg, tiny, 62 tokens: 4 writes of 31 KiB): layer-wise
# prefill_compute 22.9 ms against push's 19.3. Where a whole chunk is under it, the chunk goes in one
# WRITE after its last layer, and the prompt's last chunk in push's final WRITE (one fewer). Over shared
# memory (Plan.gather) such a chunk waits for the next chunk's WRITE instead: the copy runs on the
# prefill's core whenever it runs, so an early WRITE hides nothing and only its fixed cost is at stake
# (tiny at 2,048 tokens, four chunks of 512 KiB: 1 WRITE while it computes instead of 3, each of which
# had cost the prefill's core ~0.5 ms, its writer's and copy thread's CPU, measured per thread, Zen 4).
# Over a link the kernel moves an early WRITE while the prompt computes: every chunk goes.
MIN_WRITE_BYTES = 1 << 20


class Geometry(msgspec.Struct, frozen=True):
    num_layers: int
    layer_bytes: int            # one layer of one block
    block_size: int             # tokens a block holds


class Plan(msgspec.Struct, frozen=True):
    skip_blocks: int = 0                    # leading blocks decode holds already: never written
    gather: bool = False                    # a chunk under MIN_WRITE_BYTES waits for the next (shared memory)
    chunk_start: int | None = None          # the chunk being sent layer by layer
    layers_sent: int = 0                    # ... how many of its layers
    group: int = 1                          # ... how many layers a WRITE of it carries
    blocks_sent: int = 0                    # leading blocks whose every layer has been queued

    @property
    def first_unsent_block(self) -> int:
        return max(self.blocks_sent, self.skip_blocks)


class Write(msgspec.Struct, frozen=True):
    blocks: range               # of the prompt's blocks
    first_layer: int
    num_layers: int


def on_layer(plan: Plan, layer: int, start: int, end: int, prompt_tokens: int, g: Geometry) -> tuple[Plan, list[Write]]:
    """Layer `layer` of the chunk of tokens [start, end) of a `prompt_tokens` prompt is computed."""
    writes = []
    last = layer == g.num_layers - 1
    blocks = range(plan.first_unsent_block, final_blocks(end, prompt_tokens, g.block_size))
    if plan.chunk_start != start:           # the first layer of this chunk we hear of
        plan = msgspec.structs.replace(plan, chunk_start=start, layers_sent=0, group=group(len(blocks), g))
    if layer + 1 - plan.layers_sent < plan.group and not last:
        return plan, writes
    whole = last and plan.layers_sent == 0  # the chunk (and what waited for it) in one WRITE
    if whole and (end >= prompt_tokens or plan.gather and len(blocks) * g.num_layers * g.layer_bytes < MIN_WRITE_BYTES):
        # the final WRITE takes it, or the next chunk's
        return msgspec.structs.replace(plan, chunk_start=None), writes
    if blocks:
        writes.append(Write(blocks, plan.layers_sent, layer + 1 - plan.layers_sent))
    plan = msgspec.structs.replace(plan, layers_sent=layer + 1)
    if last:
        plan = msgspec.structs.replace(plan, blocks_sent=max(plan.blocks_sent, blocks.stop), chunk_start=None)
    return plan, writes


def write_layers(plan: Plan, end: int, prompt_tokens: int, g: Geometry) -> set[int]:
    """The layers of a chunk ending at token `end` after which on_layer may have a WRITE to give (the
    last layer of each group, and the chunk's last): the only ones it needs to hear of."""
    step = group(len(range(plan.first_unsent_block, final_blocks(end, prompt_tokens, g.block_size))), g)
    return {*range(step - 1, g.num_layers - 1, step), g.num_layers - 1}


def group(num_blocks: int, g: Geometry) -> int:
    """Layers a WRITE of this chunk carries: a share of them, and at least MIN_WRITE_BYTES."""
    return max(-(-g.num_layers // LAYER_WRITES_PER_CHUNK), -(-MIN_WRITE_BYTES // max(1, num_blocks * g.layer_bytes)))


def final_blocks(end: int, prompt_tokens: int, block_size: int) -> int:
    """How many leading blocks hold final K/V once the tokens before `end` are computed: the block
    `end` falls in only if the prompt ends there too."""
    return -(-end // block_size) if end >= prompt_tokens else end // block_size
