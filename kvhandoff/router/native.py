"""The router's attempt in front of kvhandoff's own workers: the messages of docs/HANDOFF.md on top of
the state and mechanics every engine shares (attempt.py). The prefill answers in JSON lines (its first
token, then its handoff object); the decode worker's events carry notes for the relay; control
messages (/kv/cancel, /kv/release, /kv/failed, /kv/rebind) keep both sides from waiting on what the
router already knows; the client's handoff object merges both workers' reports with the router's
own phases. vllm.py is the same for vLLM's workers."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from kvhandoff.router.answer import Answer, UpstreamError
from kvhandoff.router.attempt import Attempt
from kvhandoff.router.errors import Relay, WorkerFailure, describe, task_outcome, worker_failure
from kvhandoff.router.policies import PrefillPolicy, late_binding_target, reuse_estimate, reuse_shortlist
from kvhandoff.router.pool import Worker
from kvhandoff.wire import messages as M
from kvhandoff.wire.cost import REUSE_FLOOR_TOKENS, common_prefix_blocks
from kvhandoff.wire.modes import Role

log = logging.getLogger("kvhandoff.router")

# Fields of the prefill's answer worth showing the client when the decode side lacks them; the rest
# (token ids, block ids, checksums, agent metadata) is protocol payload, not observability.
PREFILL_FALLBACK_FIELDS = ("bytes_transferred", "bytes_before_prefill_end", "blocks", "reused_tokens",
                           "reverse_bytes", "reuse_decision", "prefill_cached_tokens")
PrefillAnswer = M.PullHandoff | M.PushPrefillAnswer


@dataclass
class NativeAttempt(Attempt):
    def reuse_estimates(self, among: list[Worker]) -> dict[str, dict] | None:
        """Cache-aware prefill for a turn whose history a decode worker retains: the cheapest way (its
        cache, a fetch, recomputing) and its estimated ms (policies.reuse_estimate) of each prefill
        worker on the shortlist (policies.reuse_shortlist, of the pick's candidates `among`: those
        holding part of the prompt, and the least queued of the others; pick() takes the others after
        them)."""
        if self.candidate is None or self.facts is None or self.config.prefill_policy is not PrefillPolicy.CACHE:
            return None
        pool = self.router.pool
        shortlist = reuse_shortlist(among, self.facts, pool.prefix, self.excluded)
        shared = common_prefix_blocks(self.facts.block_hashes, self.candidate.block_hashes)
        return {w.url: reuse_estimate(w, self.facts, pool.prefix, shared, REUSE_FLOOR_TOKENS) for w in shortlist}

    async def run_prefill(self, **extra) -> PrefillAnswer:
        """Run the prefill leg to its end; returns the prefill's answer (its handoff object, typed by
        mode). Its first token resolves `first_token` as soon as it is here."""
        worker = self.prefill
        first_token = self.first_token
        try:
            self.prefill_sent_ms = self.ms()
            resp = await self.post(worker, self.worker_body(Role.PREFILL, **extra))
            if not self.prefill_opened.done():
                self.prefill_opened.set_result(None)
            if resp.content_type.startswith("application/x-ndjson"):
                handoff = await self.read_prefill_lines(worker, resp)
            else:       # one JSON answer: a worker that sends no first token (the relay waits for decode's)
                handoff = (await self.read_json(worker, resp)).get("handoff")
        finally:
            if not first_token.done():
                first_token.set_result(None)
        self.unhold(worker)
        if not isinstance(handoff, dict):
            raise WorkerFailure(worker, f"the prefill worker {worker.url} answered without a handoff object; is "
                                "it running with --role prefill?", "bad_worker_answer")
        try:
            answer = M.parse(M.PullHandoff if self.mode.is_pull else M.PushPrefillAnswer, handoff,
                             "the prefill's handoff object")
        except M.MessageError as exc:       # (the leg stays open: release_legs tells it /kv/cancel)
            raise WorkerFailure(worker, f"the {worker} answered a malformed handoff object: {exc}",
                                "bad_worker_answer") from None
        # The leg closes and its pin is known in one step, with no await between: a client gone before
        # the decode leg resumed once found neither ("prefill" closed, `remote` not yet set by the leg
        # that awaited this answer), told nobody, and the prefill held 64 blocks until the lease ended.
        if self.mode.is_pull:
            self.remote = answer
        self.open_legs.discard(Role.PREFILL)
        self.score_index(worker, answer.prefill_cached_tokens)
        return answer

    def score_index(self, worker: Worker, actual: int) -> None:
        """What the KV-event index said this prefill worker caches of the prompt, against what it had."""
        facts = self.facts
        if facts is None or not facts.keys or worker.url not in facts.cached:
            return
        # (A worker never takes the prompt's last token from its cache: it computes at least that one.)
        predicted = min(facts.cached[worker.url], (facts.num_tokens - 1) // facts.block_size) * facts.block_size
        metrics = self.router.metrics
        metrics.child(metrics.index_tokens, "predicted").inc(predicted)
        metrics.child(metrics.index_tokens, "actual").inc(actual)
        if actual < predicted:
            metrics.index_misses.inc()

    async def read_prefill_lines(self, worker: Worker, resp: Answer) -> dict | None:
        """The prefill's JSON lines: the first token (handed on at once), then the handoff object, or
        the error that ended the handoff after its first token."""
        try:
            async for raw in resp.lines():
                try:
                    line = M.parse(M.PrefillLine, raw, "the prefill's answer")
                except M.MessageError as exc:
                    raise WorkerFailure(worker, f"the {worker} answered a malformed line: {exc}",
                                        "bad_worker_answer") from None
                if line.first_token is not None and not self.first_token.done():
                    self.first_received_ms = self.ms()
                    self.first_token.set_result(line.first_token)
                elif line.error is not None:
                    raise Relay(worker, line.status, {"error": line.error})
                elif line.handoff is not None:
                    return line.handoff
        except UpstreamError as e:
            raise worker_failure(worker, e) from None
        return None

    async def resume_on(self, worker: Worker, token_ids: list[int], emitted_chars: int) -> Answer:
        """Migration: the client's request to `worker` (picked: held), continued after the tokens it
        was sent (computed from the prompt if none)."""
        self.decode = worker
        resume = {"resume_token_ids": token_ids, "emitted_chars": emitted_chars} if token_ids else {}
        return await self.post(worker, self.worker_body(Role.DECODE, colocated=True, **resume))

    def fallen_behind(self) -> tuple[Worker, float, float] | None:
        """Late binding: (where to move the decode leg, the wait expected here, there), or None."""
        return late_binding_target(self.decode, self.router.pool.serving(Role.DECODE), self.excluded)

    async def rebind(self) -> str | None:
        """Late binding: ask the prefill worker to withdraw the decode worker's registration and take
        the next binding's instead. None if it did; else why not (its WRITE has started, ...)."""
        body = M.Rebind(handoff_id=self.handoff_id, binding=self.binding + 1)
        try:
            status, answer = await self.router.upstream.call("POST", self.prefill.url + "/kv/rebind", body, timeout=5.0)
        except UpstreamError as e:
            return describe(e)
        if status != 200:
            error = answer.get("error") if isinstance(answer, dict) else None
            return (error.get("message") if isinstance(error, dict) else None) or str(status)
        self.binding += 1
        return None

    async def move_decode(self, target: Worker, leg: asyncio.Task) -> asyncio.Task:
        """Late binding, after a rebind: close the decode leg on the worker left behind (it frees its
        blocks: the prefill told it nothing will be written there) and open one on `target`."""
        leg.cancel()
        await asyncio.wait({leg})
        if not leg.cancelled() and leg.exception() is None:
            resp = leg.result()
            self.upstream.remove(resp)
            resp.close()
        self.abandon(Role.DECODE)
        self.unhold(self.decode)
        self.router.pool.hold(target, self.facts)
        self.holding.append(target)
        self.rebound_from, self.decode = self.decode.url, target
        return asyncio.ensure_future(self.open_decode(prefill_url=self.prefill.url, binding=self.binding))

    def report_prefill_failure(self, failure: BaseException) -> None:
        """Push: the prefill leg failed with both legs out: the decode worker hears it now (/kv/failed)."""
        _, reason = task_outcome(self.prefill_task)
        self.router.tell(self.decode, "/kv/failed", M.KVFailed(
            handoff_id=self.handoff_id, reason=f"prefill worker {self.prefill.url}: {reason}",
            prefill_answered=isinstance(failure, Relay), recompute=True if self.config.retry_colocated else None))

    def worker_body(self, role: Role, **extra) -> dict:
        bidirectional = self.config.bidirectional
        extra["created"] = self.created
        if bidirectional and role == Role.PREFILL and self.candidate is not None:
            extra["reuse"] = self.candidate.candidate()
        if bidirectional and role == Role.DECODE and not extra.get("colocated"):
            extra["retain"] = True
            if self.session_id is not None:
                extra["session"] = self.session_id      # kept with the turn: any router finds it by it
            if self.candidate is not None and self.candidate.decode_url == self.decode.url:
                extra["supersedes"] = self.candidate.retention_id
        body = self.body
        if role == Role.PREFILL:   # prefill answers one JSON object, whatever the client asked for
            body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        return {**body, "kv_transfer_params": M.params(self.handoff_id, self.mode, role, **extra)}

    async def merge(self, decode_handoff: dict | None) -> M.ClientHandoff:
        """The client's handoff object: the decode worker's report, with the prefill's phases and ours
        added. Merged once (the final chunk and the usage chunk both carry it). After a migration the
        worker that finished the stream computed it colocated and reports no handoff (None)."""
        if self.merged is not None:
            return self.merged
        prefill, prefill_error = await self.prefill_outcome(self.remote)
        decode = self.decode_report(decode_handoff)
        pre = prefill.phases_ms if prefill is not None else {}
        dec = decode.phases_ms if decode is not None else {}
        # handoff_wait and transfer may come from both sides; the one that moved the data (decode READs
        # in pull, prefill WRITEs in push) measured the transfer itself, so its view wins.
        first, second = (dec, pre) if self.mode.is_pull else (pre, dec)
        phases = {p: first.get(p) if first.get(p) is not None else second.get(p) for p in M.PHASES}
        phases.update(self.ttft_phases())
        merged = M.ClientHandoff(self.handoff_id, self.mode, self.prefill.url if self.prefill else None,
                                 self.decode.url, phases, self.router_ms)
        if decode is not None:
            merged.kv_source, merged.error = decode.kv_source, decode.error
            merged.bytes_transferred, merged.blocks = decode.bytes_transferred, decode.blocks
            merged.decode_cached_tokens = decode.decode_cached_tokens
        for name in PREFILL_FALLBACK_FIELDS:      # (0 and None alike: the prefill did not say)
            if getattr(merged, name) is None and getattr(prefill, name, None):
                setattr(merged, name, getattr(prefill, name))
        if self.migrations:
            merged.migrated = self.migrations
        if self.first_token_ms is not None:         # (a stream: which answer its first token came from)
            merged.first_token_source = Role.PREFILL if self.first_from_prefill else Role.DECODE
        merged.prefill_error, merged.rebound_from = prefill_error, self.rebound_from
        if self.route_decision:       # beside its estimate, what the chosen worker took (queue + prompt)
            spent = [phases.get(p) for p in ("prefill_queue", "prefill_compute")]
            measured = round(sum(spent), 3) if None not in spent else None
            merged.route_decision = {**self.route_decision, "measured_ms": measured}
        merged.retried_elsewhere = self.retry_reason
        self.merged = merged
        self.router.merged(self, merged, decode.retained if decode is not None else None)
        return merged

    def decode_report(self, handoff: dict | None) -> M.DecodeReport | None:
        """The decode worker's handoff object, parsed; a malformed one costs the client only its
        observability (the tokens are out), so it is logged, not raised."""
        if not handoff:
            return None
        try:
            return M.parse(M.DecodeReport, handoff, "the decode worker's handoff object")
        except M.MessageError as exc:
            log.warning("handoff %s: %s answered %s", self.handoff_id, self.decode, exc)
            return None

    def ttft_phases(self) -> dict:
        """The router's phases of the first token's critical path (messages.TTFT_PHASES, with the
        prefill's queue and compute): arrival -> prefill leg sent; the hops there and back (the wait
        for the first token less the prefill worker's own time); the worker's time outside its
        queue and compute (parsing, tokenizing, admission, the answer); our relay to the client."""
        first = self.first_token.result() if self.first_token.done() else None
        if first is None or self.first_received_ms is None or self.prefill_sent_ms is None:
            return {}
        worker = first.phases_ms
        spent = [worker.get(p) for p in ("prefill_worker", "prefill_queue", "prefill_compute")]
        phases = {"router_dispatch": self.prefill_sent_ms}
        if None not in spent:
            phases["prefill_hops"] = round(self.first_received_ms - self.prefill_sent_ms - spent[0], 3)
            phases["prefill_request"] = round(spent[0] - spent[1] - spent[2], 3)
        if self.first_from_prefill and self.first_token_ms is not None:
            phases["relay"] = round(self.first_token_ms - self.first_received_ms, 3)
        return phases
