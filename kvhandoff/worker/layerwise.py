"""Layer-wise push (docs/HANDOFF.md, "Push and push-layerwise"): push, with the KV leaving while later
layers and later chunks are still being computed, so that on a slow link the transfer hides behind
the prefill instead of following it. Everything else (registration, Done, failures) is push.py's.

After each group of layers of each prefill chunk (LAYER_WRITES_PER_CHUNK groups a chunk: the
per-write overhead, paid on the prefill's own core, is then not paid per layer; a layer's adjacent
blocks are one range on each side, kv_layout.py; fewer groups where
a group's bytes would be under MIN_WRITE_BYTES) the engine calls on_layer, and the writer thread
WRITEs those layers of the chunk's blocks. Each (block, layer) range is written exactly once, when
it is final, so writes never overlap and their order does not matter:
- a chunk writes the blocks it completes: a block it only starts (the prompt goes on past the
  chunk) waits for the chunk that completes it;
- a registration that arrives after some chunks (or layers) were computed first catches up: the
  blocks completed so far, all layers at once, then the current chunk's computed layers;
- the final WRITE (push.py) covers whatever is left, and carries Done.
A registration that has had a layer computed for it is committed: late binding can no longer move it.
What left before the prompt was computed is reported (bytes_before_prefill_end); the `transfer`
phase is what is left after it, the part of the transfer the client waits for.
"""
from __future__ import annotations

import time

from kvhandoff.worker.push import PushJob, PushPrefill

LAYER_WRITES_PER_CHUNK = 6      # SmolLM2's 30 layers: 5 at a time
# ... but no write under this many bytes: a WRITE costs ~0.2 ms of the prefill's core whatever its size
# (descriptors, the writer thread taking the GIL from the engine's), about what copying 1 MiB through
# shared memory takes. Measured (bench.disagg, tiny, 62 tokens: 4 writes of 31 KiB): layer-wise
# prefill_compute 22.9 ms against push's 19.3. Where a whole chunk is under it, the chunk goes in one
# WRITE after its last layer, and the prompt's last chunk in push's final WRITE (one fewer).
MIN_WRITE_BYTES = 1 << 20


class LayerwisePrefill(PushPrefill):
    """The prefill side of both push modes: jobs of mode push-layerwise also write layer by layer."""

    def on_layer(self, layer: int, chunks) -> None:
        """Engine thread, after `layer` of this step's chunks: queue what became final."""
        num_layers = self.rt.layout.num_layers
        last = layer == num_layers - 1
        for chunk in chunks:
            request = chunk.request
            side, job = self.rt.requests.get(request.request_id, (None, None))
            if side is not self or not job.layerwise or not self._commit(job) or job.started:
                continue
            start = request.num_computed_tokens
            end = start + chunk.num_new_tokens
            if job.chunk_start != start:            # the first layer of this chunk we hear of
                self._catch_up(job, start, request.block_table)
                job.chunk_start, job.layers_sent = start, 0
                job.group = self._group(len(range(self.first_unsent_block(job), self._final_blocks(request, end))))
            if layer + 1 - job.layers_sent < job.group and not last:
                continue
            if last and job.layers_sent == 0 and end >= request.num_prompt_tokens:
                job.chunk_start = None              # the final WRITE takes the whole chunk
                continue
            blocks = range(self.first_unsent_block(job), self._final_blocks(request, end))
            if blocks:
                self._queue(job, request.block_table, blocks, job.layers_sent, layer + 1 - job.layers_sent)
            job.layers_sent = layer + 1
            if last:
                job.blocks_sent, job.chunk_start = max(job.blocks_sent, blocks.stop), None

    def _group(self, num_blocks: int) -> int:
        """Layers a WRITE of this chunk carries: a share of them, and at least MIN_WRITE_BYTES."""
        layout = self.rt.layout
        return max(-(-layout.num_layers // LAYER_WRITES_PER_CHUNK),
                   -(-MIN_WRITE_BYTES // max(1, num_blocks * layout.layer_bytes)))

    @staticmethod
    def _commit(job: PushJob) -> bool:
        """Is there a registration to write layers to? From the first yes on, the handoff is bound to it
        (a late-binding Rebind is refused): layers may be on their way there."""
        if not job.committed:
            with job.lock:
                job.committed = job.registration is not None
        return job.committed

    def _final_blocks(self, request, end: int) -> int:
        """How many leading blocks hold final K/V once the tokens before `end` are computed: the block
        `end` falls in only if the prompt ends there too."""
        bs = self.rt.block_size
        return -(-end // bs) if end >= request.num_prompt_tokens else end // bs

    def _catch_up(self, job: PushJob, start: int, block_table: list[int]) -> None:
        """Blocks completed before this chunk that were not sent (the registration came late)."""
        first = max(job.blocks_sent, job.registration.skip_blocks)
        done = start // self.rt.block_size
        if done > first:
            self._queue(job, block_table, range(first, done), 0, self.rt.layout.num_layers)
            job.blocks_sent = done

    def _queue(self, job: PushJob, block_table: list[int], blocks: range, first_layer: int, num_layers: int) -> None:
        local = [block_table[b] for b in blocks]
        remote = [job.registration.block_ids[b] for b in blocks]
        self.rt.writer.put(lambda: self._write_layers(job, local, remote, first_layer, num_layers),
                           self.rt.cfg.faults.due())

    def _write_layers(self, job: PushJob, local: list[int], remote: list[int], first_layer: int,
                      num_layers: int) -> None:
        """Writer thread: post (never wait here: the final WRITE waits for them all)."""
        if job.failed is not None:
            return
        layout, remote_layout = self.rt.layout, self.rt.layout.peer(job.registration.pool_blocks)
        job.pending.append(self.rt.agent.write(job.peer, layout.layer_descs(local, first_layer, num_layers),
                                               remote_layout.layer_descs(remote, first_layer, num_layers)))
        self.rt.cfg.faults.reached("transfer", job.handoff_id)

    # ---- push.py's hooks ---------------------------------------------------------------------------
    def before_final_write(self, job: PushJob) -> None:
        """Every layer-wise WRITE must be in before Done goes out; count what left before the prompt
        was computed."""
        for handle in job.pending:
            handle.wait(self.rt.cfg.kv_timeout_s)
            job.bytes_sent += handle.nbytes
            if handle.finished_at is not None and handle.finished_at <= job.prefilled_perf:
                job.bytes_before_prefill_end += handle.nbytes

    def first_unsent_block(self, job: PushJob) -> int:
        return max(job.blocks_sent, job.registration.skip_blocks)

    def extra_answer(self, job: PushJob) -> dict:
        return {"bytes_before_prefill_end": job.bytes_before_prefill_end} if job.layerwise else {}

    def finished(self, job: PushJob, request, out) -> bool:
        job.prefilled_perf = time.perf_counter()        # (handles time themselves with perf_counter)
        return super().finished(job, request, out)
