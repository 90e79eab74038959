"""Layer-wise push (docs/HANDOFF.md, "Push and push-layerwise"): push, with the KV leaving while later
layers and later chunks are still being computed, so that on a slow link the transfer hides behind
the prefill instead of following it. Everything else (registration, Done, failures) is push.py's;
which (blocks, layers) each WRITE carries is protocol/layers.py's plan.

After the layers of each prefill chunk where the plan may give a WRITE (layer_hook) the engine calls
on_layer; the writer thread posts the WRITEs the plan gives. A registration that has had a layer
computed for it is committed: late binding can no longer move it. What left before the prompt was
computed is reported (bytes_before_prefill_end); the `transfer` phase is what is left after it, the
part of the transfer the client waits for.
"""
from __future__ import annotations

import time
from typing import Callable

from kvhandoff.worker.protocol import layers as L
from kvhandoff.worker.protocol import push_prefill as S
from kvhandoff.worker.push import PushJob, PushPrefill


class LayerwisePrefill(PushPrefill):
    """The prefill side of both push modes: jobs of mode push-layerwise also write layer by layer."""

    def __init__(self, **parts):
        super().__init__(**parts)
        layout = self.door.layout
        self.geometry = L.Geometry(layout.num_layers, layout.layer_bytes, self.door.block_size)

    def layer_hook(self, chunks) -> Callable[[int], None] | None:
        """Engine thread, before a step's forward: its per-layer call, made only after the layers where
        a WRITE may leave (a call cost the engine's core ~35 us, from caches the layer's weights had
        just gone through: tiny's 2,048-token prompt made 16 of them); none for a step with no
        layer-wise job that has a registration to write to (one that comes meanwhile catches up
        with the next chunk)."""
        wanted = set()
        for chunk in chunks:
            request = chunk.request
            side, job = self.door.requests.get(request.request_id, (None, None))
            if side is self and self._writable(job):
                plan = job.layers or L.Plan(skip_blocks=job.state.registration.skip_blocks)
                end = request.num_computed_tokens + chunk.num_new_tokens
                wanted |= L.write_layers(plan, end, request.num_prompt_tokens, self.geometry)
        return (lambda layer: layer in wanted and self.on_layer(layer, chunks)) if wanted else None

    @staticmethod
    def _writable(job: PushJob) -> bool:
        state = job.state
        return (state.layerwise and state.registration is not None
                and state.phase not in (S.Phase.WRITING, S.Phase.ENDED))

    def on_layer(self, layer: int, chunks) -> None:
        """Engine thread, after `layer` of this step's chunks: queue what became final."""
        for chunk in chunks:
            request = chunk.request
            side, job = self.door.requests.get(request.request_id, (None, None))
            if side is not self or not self._writable(job) or not self._commit(job):
                continue
            start = request.num_computed_tokens
            job.layers, writes = L.on_layer(job.layers, layer, start, start + chunk.num_new_tokens,
                                            request.num_prompt_tokens, self.geometry)
            for write in writes:
                self._queue(job, request.block_table, write)

    def _commit(self, job: PushJob) -> bool:
        """Is there a registration to write layers to? From the first yes on, the handoff is bound to it
        (a late-binding Rebind is refused): layers may be on their way there."""
        if not job.state.committed:
            self.step(job, S.LayerComputed())
            if not job.state.committed:
                return False
            job.layers = L.Plan(skip_blocks=job.state.registration.skip_blocks,
                                gather=self.peers.backend(job.state.peer) == "shm")
        return True

    def _queue(self, job: PushJob, block_table: list[int], write: L.Write) -> None:
        registration = job.state.registration
        local = [block_table[b] for b in write.blocks]
        remote = [registration.block_ids[b] for b in write.blocks]
        self.chores.writer.put(lambda: self._write_layers(job, local, remote, write.first_layer, write.num_layers),
                               self.cfg.faults.due())

    def _write_layers(self, job: PushJob, local: list[int], remote: list[int], first_layer: int,
                      num_layers: int) -> None:
        """Writer thread: post (never wait here: the final WRITE waits for them all)."""
        if job.state.failed is not None:
            return
        state = job.state
        layout, remote_layout = self.door.layout, self.door.layout.peer(state.registration.pool_blocks)
        job.pending.append(self.peers.write(state.peer, layout.layer_descs(local, first_layer, num_layers),
                                            remote_layout.layer_descs(remote, first_layer, num_layers)))
        self.cfg.faults.reached("transfer", job.handoff_id)

    # ---- push.py's hooks ---------------------------------------------------------------------------
    def before_final_write(self, job: PushJob) -> None:
        """Every layer-wise WRITE must be in before Done goes out; count what left before the prompt
        was computed."""
        for handle in job.pending:
            handle.wait(self.cfg.kv_timeout_s)
            job.bytes_sent += handle.nbytes
            if handle.finished_at is not None and handle.finished_at <= job.prefilled_perf:
                job.bytes_before_prefill_end += handle.nbytes

    def first_unsent_block(self, job: PushJob) -> int:
        return job.layers.first_unsent_block if job.layers is not None else job.state.registration.skip_blocks

    def extra_answer(self, job: PushJob) -> dict:
        return {"bytes_before_prefill_end": job.bytes_before_prefill_end} if job.state.layerwise else {}

    def finished(self, job: PushJob, request, out) -> bool:
        job.prefilled_perf = time.perf_counter()        # (handles time themselves with perf_counter)
        return super().finished(job, request, out)
