"""One client request through the router, and its current attempt: the workers it holds, its two legs
(the protocol's router leg, handoff/pull.py or push.py, sequences them), the merge of what both
workers report, and the end that closes everything.

A request lives through explicit phases (Phase): OPENING (legs going out), ANSWERING (the decode
worker's answer is open, the client has no token yet: a failure can still be retried invisibly),
STREAMING (the client saw a token: no retry any more), DRAINED (the answer was read to its end),
ENDED (closed and counted). A retry on other workers starts a new attempt, with a new handoff id.

Ownership of upstream connections: every response opened to a worker is recorded on the attempt
and closed by `release_legs`, whichever way the request ends (done, worker error, client gone,
deadline). Closing a half-read response closes its TCP connection, which is how a worker learns that
nobody listens any more and aborts the request, freeing its blocks.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum

import httpx

from kvhandoff.handoff import messages as M
from kvhandoff.handoff.config import ReuseConfig
from kvhandoff.serve.router.errors import (Relay, WorkerFailure, describe, error_json, failure_message, refused,
                                           status_of, task_outcome, worker_failure)
from kvhandoff.serve.router.policies import PrefillPolicy, late_binding_target, reuse_estimate
from kvhandoff.serve.router.pool import Worker
from kvhandoff.serve.router.prefix import PromptFacts
from kvhandoff.serve.router.sessions import SessionEntry

log = logging.getLogger("kvhandoff.router")

# The prefill workers' floor (--reuse-min-tokens), at its default: the router is not told theirs.
REUSE_FLOOR_TOKENS = ReuseConfig().min_tokens
# Fields of the prefill's handoff object worth showing the client when the decode side lacks them;
# the rest (token ids, block ids, checksums, agent metadata) is protocol payload, not observability.
PREFILL_FALLBACK_FIELDS = ("bytes_transferred", "bytes_before_prefill_end", "blocks", "reused_tokens",
                           "reverse_bytes", "reuse_decision", "prefill_cached_tokens")
# Push: how long the decode side's final answer waits for the prefill's (normally there already: the
# prefill answers once its WRITE is done, before decode can finish). Bounded, so a prefill that hangs
# delays nobody's last chunk by more than this.
PREFILL_ANSWER_GRACE_S = 5.0


class Phase(Enum):
    OPENING = "opening"
    ANSWERING = "answering"
    STREAMING = "streaming"
    DRAINED = "drained"
    ENDED = "ended"


@dataclass
class Attempt:
    router: object                                # app.Router: config, pool, client, metrics
    endpoint: str
    stream: bool
    t0: float                                     # perf_counter at arrival
    deadline: float                               # event-loop time after which the router gives up
    body: dict = field(default_factory=dict)      # the client's body, as it came
    handoff_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    phase: Phase = Phase.OPENING
    status: str = "200"                           # metrics label of the outcome
    router_ms: float | None = None                # arrival -> first byte sent to a worker
    decode_sent_ms: float | None = None           # arrival -> the decode leg sent
    first_token_ms: float | None = None           # streams: when the first generated text went out
    session_id: str | None = None                 # bidirectional: the client's name for the conversation
    candidate: SessionEntry | None = None         # bidirectional: where its history's KV is kept
    attempts: int = 1                             # 2 after a retry on other workers
    excluded: set[str] = field(default_factory=set)   # workers that failed this request
    retry_reason: str | None = None               # why the first attempt was given up
    facts: PromptFacts | None = None              # the prompt's tokens and block hashes (cache-aware, selective)
    # this attempt's
    prefill: Worker | None = None
    decode: Worker | None = None
    prefill_task: asyncio.Task | None = None      # push: resolves to the prefill's handoff object
    remote: dict | None = None                    # pull: the prefill's handoff object (blocks pinned)
    upstream: list[httpx.Response] = field(default_factory=list)
    open_legs: set[str] = field(default_factory=set)      # roles sent a request whose answer we lack
    holding: list[Worker] = field(default_factory=list)   # in_flight counted on these
    retried: str | None = None                    # why the request was computed colocated on the decode worker
    kv_source: str = "retried_colocated"          # ... after a failed prefill, or "colocated" (selective)
    merged: dict | None = None                    # the client's handoff object, once merged
    binding: int = 0                              # late binding: how often the decode leg was moved
    rebound_from: str | None = None               # ... and the decode worker it left
    route_decision: dict | None = None            # bidirectional + cache-aware: cache, fetch or recompute, and why

    @property
    def config(self):
        return self.router.config

    @property
    def mode(self) -> M.Mode:
        return self.config.mode

    def ms(self) -> float:
        return round((time.perf_counter() - self.t0) * 1e3, 3)

    @property
    def ended(self) -> bool:
        return self.phase is Phase.ENDED

    @property
    def decode_opened(self) -> bool:
        """The decode worker's answer has started."""
        return self.phase not in (Phase.OPENING, Phase.ENDED)

    @property
    def retryable(self) -> bool:
        """No token has reached the client: a retry can still be invisible."""
        return self.phase in (Phase.OPENING, Phase.ANSWERING) and self.attempts == 1

    def next_attempt(self) -> None:
        """Forget the abandoned attempt's legs: the retry is a new handoff with its own id."""
        self.attempts += 1
        self.handoff_id = uuid.uuid4().hex
        self.prefill = self.decode = self.prefill_task = self.remote = self.merged = None
        self.upstream, self.open_legs, self.holding = [], set(), []
        self.retried, self.kv_source = None, "retried_colocated"
        self.binding, self.rebound_from, self.route_decision = 0, None, None
        self.phase = Phase.OPENING

    # -- what the protocols' router legs call (handoff/pull.py, push.py) -----------------------------
    def pick(self, role: str, prefer: str | None = None) -> Worker:
        estimates = self.reuse_estimates() if role == "prefill" else None
        cost = (lambda w: estimates[w.url]["est_ms"]) if estimates else None
        worker = self.router.pool.pick(role, self.excluded, prefer, self.facts, cost)
        if estimates:
            self.route_decision = {"choice": estimates[worker.url]["option"], "prefill_worker": worker.url,
                                   "candidates": list(estimates.values())}
        self.holding.append(worker)
        return worker

    def reuse_estimates(self) -> dict[str, dict] | None:
        """Cache-aware prefill for a turn whose history a decode worker retains: each prefill worker's
        cheapest way (its cache, a fetch, recomputing) and its estimated ms (policies.reuse_estimate)."""
        if self.candidate is None or self.facts is None or self.config.prefill_policy is not PrefillPolicy.CACHE:
            return None
        pool = self.router.pool
        return {w.url: reuse_estimate(w, self.facts, pool.prefix, self.candidate.block_hashes, REUSE_FLOOR_TOKENS)
                for w in pool.serving("prefill")}

    @property
    def history_worker(self) -> str | None:
        """Bidirectional: the decode worker holding the conversation's history, preferred."""
        return self.candidate.decode_url if self.candidate is not None else None

    async def run_prefill(self, **extra) -> dict:
        """Run the prefill leg to its end; returns the prefill's handoff object."""
        worker = self.prefill
        resp = await self.post(worker, self.worker_body("prefill", **extra))
        data = await self.read_json(worker, resp)
        self.open_legs.discard("prefill")
        self.unhold(worker)
        handoff = data.get("handoff")
        if not isinstance(handoff, dict):
            raise WorkerFailure(worker, f"the prefill worker {worker.url} answered without a handoff object; is "
                                "it running with --role prefill?", "bad_worker_answer")
        return handoff

    async def open_decode(self, **extra) -> httpx.Response:
        """Send the decode leg; returns its open answer (status line read)."""
        self.decode_sent_ms = self.ms()
        resp = await self.post(self.decode, self.worker_body("decode", **extra))
        self.phase = Phase.ANSWERING
        return resp

    def may_retry_colocated(self, failure: BaseException) -> bool:
        """A prefill failure the decode worker could make good by computing the request itself: the
        worker's fault (5xx, unreachable, died), not the request's (4xx would fail there too)."""
        return self.config.retry_colocated and status_of(failure) >= 500

    async def retry_colocated(self, failure: BaseException) -> httpx.Response:
        """Send the client's request, as it came, to the decode worker: it computes it colocated."""
        reason = failure_message(failure)
        log.warning("handoff %s: prefill failed (%s); retrying colocated", self.handoff_id, reason)
        return await self.run_colocated(f"prefill failed ({reason})", "retried_colocated")

    async def run_colocated(self, why: str, kv_source: str) -> httpx.Response:
        """The client's request, as it came, to a decode worker, which computes it itself."""
        if self.decode is None:
            self.decode = self.pick("decode")
        self.retried, self.kv_source = f"{why}; computed colocated on {self.decode.url}", kv_source
        self.remote = None                  # nothing pinned to release
        self.decode_sent_ms = self.ms()
        resp = await self.post(self.decode, self.body)
        self.phase = Phase.ANSWERING
        return resp

    def refused(self, failure: BaseException | None) -> bool:
        return refused(failure)

    def abandon(self, role: str) -> None:
        """This leg's answer was closed unread: the worker frees what it holds for it."""
        self.open_legs.discard(role)
        self.tell(self.decode if role == "decode" else self.prefill, "/kv/cancel")

    def fallen_behind(self) -> tuple[Worker, float, float] | None:
        """Late binding: (where to move the decode leg, the wait expected here, there), or None."""
        return late_binding_target(self.decode, self.router.pool.serving("decode"), self.excluded)

    async def rebind(self) -> str | None:
        """Late binding: ask the prefill worker to withdraw the decode worker's registration and take
        the next binding's instead. None if it did; else why not (its WRITE has started, ...)."""
        body = {"handoff_id": self.handoff_id, "binding": self.binding + 1}
        try:
            resp = await self.router.client.post(self.prefill.url + "/kv/rebind", json=body,
                                                 headers=self.router.auth, timeout=5.0)
        except httpx.HTTPError as e:
            return describe(e)
        if resp.status_code != 200:
            return (await error_json(self.prefill, resp)).get("error", {}).get("message") or str(resp.status_code)
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
            await resp.aclose()
        self.abandon("decode")
        self.unhold(self.decode)
        self.router.pool.hold(target, self.facts)
        self.holding.append(target)
        self.rebound_from, self.decode = self.decode.url, target
        return asyncio.ensure_future(self.open_decode(prefill_url=self.prefill.url, binding=self.binding))

    def report_prefill_failure(self, failure: BaseException) -> None:
        """Push: the prefill leg failed with both legs out: the decode worker hears it now (/kv/failed)."""
        _, reason = task_outcome(self.prefill_task)
        fields = {"recompute": True} if self.config.retry_colocated else {}
        self.tell(self.decode, "/kv/failed", reason=f"prefill worker {self.prefill.url}: {reason}",
                  prefill_answered=isinstance(failure, Relay), **fields)

    # -- talking to workers ---------------------------------------------------------------------------
    def worker_body(self, role: str, **extra) -> dict:
        bidirectional = self.config.bidirectional
        if bidirectional and role == "prefill" and self.candidate is not None:
            extra["reuse"] = self.candidate.candidate()
        if bidirectional and role == "decode":
            extra["retain"] = True
            if self.candidate is not None and self.candidate.decode_url == self.decode.url:
                extra["supersedes"] = self.candidate.retention_id
        body = self.body
        if role == "prefill":   # prefill answers one JSON object, whatever the client asked for
            body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        return {**body, "kv_transfer_params": M.params(self.handoff_id, self.mode, role, **extra)}

    async def post(self, worker: Worker, body: dict) -> httpx.Response:
        """POST and return the open 200 response (body unread); any other answer raises Relay/APIError."""
        client = self.router.client
        request = client.build_request("POST", worker.url + self.endpoint, json=body, headers=self.router.auth)
        if self.router_ms is None:
            self.router_ms = self.ms()
        self.open_legs.add(worker.role)
        try:
            resp = await client.send(request, stream=True)
        except httpx.TransportError as e:
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                self.open_legs.discard(worker.role)        # it never saw the request
            raise worker_failure(worker, e) from None
        self.upstream.append(resp)
        if resp.status_code != 200:
            body = await error_json(worker, resp)
            self.open_legs.discard(worker.role)            # it answered: it holds nothing for us
            raise Relay(worker, resp.status_code, body, resp.headers.get("retry-after"))
        return resp

    async def read_json(self, worker: Worker, resp: httpx.Response) -> dict:
        try:
            data = json.loads(await resp.aread())
        except httpx.TransportError as e:
            raise worker_failure(worker, e) from None
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise WorkerFailure(worker, f"the {worker} answered something that is not a JSON object",
                                "bad_worker_answer")
        return data

    def tell(self, worker: Worker, path: str, **fields) -> None:
        """Fire-and-forget control message about this handoff (/kv/cancel, /kv/release, /kv/failed).
        All are idempotent on the worker, so telling a worker that already knows costs nothing."""
        self.router.tell(worker, path, {"handoff_id": self.handoff_id, **fields})

    def unhold(self, worker: Worker) -> None:
        if worker in self.holding:
            self.holding.remove(worker)
            self.router.pool.release(worker, self.facts)

    async def release_legs(self, drained: bool = False) -> None:
        """Close this attempt's upstream answers and tell its workers to free what they hold for it
        (`drained`: the decode answer was read to its end)."""
        for resp in self.upstream:
            await resp.aclose()
        if self.prefill_task is not None:
            if not self.prefill_task.done():
                self.prefill_task.cancel()      # closes its connection: prefill aborts, frees its blocks
            self.prefill_task.add_done_callback(task_outcome)   # consume its exception: no warning
        for worker in list(self.holding):
            self.unhold(worker)
        # A worker handling a request does not notice that the router hung up until it next writes to
        # us (a prefill waiting for its engine, a decode waiting for KV): tell it, so it frees blocks now.
        if "prefill" in self.open_legs:
            self.tell(self.prefill, "/kv/cancel")
        elif self.remote is not None and not drained:
            self.tell(self.prefill, "/kv/release")    # pull: nobody will read the pinned blocks
        if "decode" in self.open_legs:
            self.tell(self.decode, "/kv/cancel")

    # -- what the client gets -------------------------------------------------------------------------
    async def merge(self, decode_handoff: dict) -> dict:
        """The client's handoff object: the decode worker's, with the prefill's phases and ours added.
        Merged once (the final chunk and the usage chunk both carry it)."""
        if self.merged is not None:
            return self.merged
        prefill, prefill_error = self.remote, None
        if self.prefill_task is not None:      # push
            await asyncio.wait({self.prefill_task}, timeout=PREFILL_ANSWER_GRACE_S)
            prefill, prefill_error = task_outcome(self.prefill_task)
        prefill = prefill or {}
        pre, dec = prefill.get("phases_ms") or {}, decode_handoff.get("phases_ms") or {}
        # handoff_wait and transfer may come from both sides; the one that moved the data (decode READs
        # in pull, prefill WRITEs in push) measured the transfer itself, so its view wins.
        first, second = (dec, pre) if self.mode.is_pull else (pre, dec)
        phases = {p: first.get(p) if first.get(p) is not None else second.get(p) for p in M.PHASES}
        merged = {**decode_handoff}
        for name in PREFILL_FALLBACK_FIELDS:
            if merged.get(name) is None and prefill.get(name) is not None:
                merged[name] = prefill[name]
        merged.update(handoff_id=self.handoff_id, mode=self.mode.value, prefill_worker=self.prefill.url,
                      decode_worker=self.decode.url, phases_ms=phases, router_ms=self.router_ms)
        if prefill_error:
            merged["prefill_error"] = prefill_error
        if self.rebound_from:
            merged["rebound_from"] = self.rebound_from
        if self.route_decision:       # beside its estimate, what the chosen worker took (queue + prompt)
            spent = [phases.get(p) for p in ("prefill_queue", "prefill_compute")]
            measured = round(sum(spent), 3) if None not in spent else None
            merged["route_decision"] = {**self.route_decision, "measured_ms": measured}
        if self.retry_reason:
            merged["retried_elsewhere"] = self.retry_reason
        self.merged = merged
        self.router.merged(self, merged)
        return merged

    def retried_handoff(self) -> dict:
        """The handoff object of a request computed colocated (the decode worker answered a plain one):
        `kv_source` says why, and the field of that name how."""
        if self.merged is None:
            self.merged = {"handoff_id": self.handoff_id, "mode": self.mode.value,
                           "prefill_worker": self.prefill.url if self.prefill else None,
                           "decode_worker": self.decode.url, "bytes_transferred": 0, "blocks": 0, "reused_tokens": 0,
                           "kv_source": self.kv_source, self.kv_source: self.retried,
                           "phases_ms": dict.fromkeys(M.PHASES), "router_ms": self.router_ms}
            if self.retry_reason:
                self.merged["retried_elsewhere"] = self.retry_reason
        return self.merged

    def timings(self, worker_timings: dict | None) -> dict:
        """`timings` as the client's request lived them, from the router's arrival, in every mode:
        queue (here and at the prefill worker), prefill (from then to the first token: compute, handoff
        and hops), ttft, decode, total. Never negative; queue + prefill = ttft."""
        t = worker_timings or {}
        total = self.ms()
        sent = self.decode_sent_ms or 0.0
        if self.first_token_ms is not None:
            ttft = self.first_token_ms
        elif t.get("ttft_ms") is not None:
            ttft = sent + t["ttft_ms"]
        else:
            ttft = None
        phases = (self.merged or {}).get("phases_ms") or {}
        if self.retried or phases.get("prefill_queue") is None:     # computed colocated on the decode worker
            queue = sent + (t.get("queue_ms") or 0.0)
        else:
            queue = (self.router_ms or 0.0) + phases["prefill_queue"]
            if ttft is not None and phases.get("prefill_compute") is not None:
                # The first token exists once the prefill worker has computed it. A non-streamed answer's
                # TTFT comes from the decode worker's clock, which starts a hop after we sent it (push
                # sends both legs at once): under load that hop is milliseconds, and unbounded the
                # estimate fell short of the prefill itself.
                ttft = max(ttft, queue + phases["prefill_compute"])
        if ttft is not None:
            ttft = min(max(ttft, 0.0), total)
            queue = min(max(queue, 0.0), ttft)
        def r(v):
            return None if v is None else round(v, 3)
        return {"queue_ms": r(queue), "prefill_ms": r(None if ttft is None else ttft - queue), "ttft_ms": r(ttft),
                "decode_ms": r(None if ttft is None else total - ttft), "total_ms": r(total)}

    def workers_named(self) -> str:
        """The workers of the current attempt, for a log line."""
        named = [str(w) for w in (self.prefill, self.decode) if w is not None]
        return " and ".join(named) or "no worker yet"


def rewrite_final(attempt: Attempt, data: dict, handoff: dict) -> dict:
    """A final chunk or answer as the client gets it: the merged handoff object and the router's timings."""
    data["handoff"] = handoff
    if "timings" in data:
        data["timings"] = attempt.timings(data.get("timings"))
    return data

