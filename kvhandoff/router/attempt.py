"""One client request through the router, and its current attempt: the state every engine shares (the
workers it holds, its two legs, which the protocol's router leg in legs.py sequences, what the client
has been sent) and the end that closes everything. What an attempt says to its workers, and how it
merges what they report, is the engine's: native.py for ours, vllm.py for vLLM's.

A request lives through explicit phases (Phase): OPENING (legs going out), ANSWERING (the decode
worker's answer is open, the client has no token yet: a failure can still be retried invisibly),
STREAMING (the client saw a token: no retry any more; a failed decode worker is migrated from,
relay.py), DRAINED (the answer was read to its end), ENDED (closed and counted). A retry on other
workers starts a new attempt, with a new handoff id.

Ownership of upstream connections: every response opened to a worker is recorded on the attempt
and closed by `release_legs`, whichever way the request ends (done, worker error, client gone,
deadline). Closing a half-read response closes its TCP connection, which is how a worker learns that
nobody listens any more and aborts the request, freeing its blocks.
"""
from __future__ import annotations

import asyncio
import math
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum

from kvhandoff.router.answer import Answer, Unreachable, UpstreamError
from kvhandoff.router.errors import (Relay, WorkerFailure, error_json, failure_message, refused,
                                           status_of, task_outcome, worker_failure)
from kvhandoff.router.pool import Worker
from kvhandoff.router.prefix import PromptFacts
from kvhandoff.router.sessions import SessionEntry
from kvhandoff.router.upstream import sse_events
from kvhandoff.wire import api as P
from kvhandoff.wire import messages as M
from kvhandoff.wire.modes import Role

log = logging.getLogger("kvhandoff.router")

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
    prefill_task: asyncio.Task | None = None      # push: resolves to the prefill's answer (PushPrefillAnswer)
    remote: M.PullHandoff | None = None           # pull: the prefill's answer (blocks pinned)
    upstream: list[Answer] = field(default_factory=list)
    open_legs: set[Role] = field(default_factory=set)      # roles sent a request whose answer we lack
    holding: list[Worker] = field(default_factory=list)   # in_flight counted on these
    retried: str | None = None                    # why the request was computed colocated on the decode worker
    kv_source: str = "retried_colocated"          # ... after a failed prefill, or "colocated" (selective)
    merged: M.ClientHandoff | None = None         # the client's handoff object, once merged
    binding: int = 0                              # late binding: how often the decode leg was moved
    rebound_from: str | None = None               # ... and the decode worker it left
    route_decision: dict | None = None            # bidirectional + cache-aware: cache, fetch or recompute, and why
    decode_task: asyncio.Task | None = None       # the decode worker's answer, opening (legs.py)
    # The first token, from the prefill's answer (messages.FirstToken; None if its answer ended without
    # one): the relay streams it to the client at once.
    first_token: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # Set once the relay has dealt with the prefill's first token (sent it, or found no text to send):
    # what can wait until the client has its token (pull's decode leg) waits for it.
    first_relayed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set once the prefill's answer has opened (status 200: the engine took the prompt). A pull stream
    # answers the client from then on, as a colocated one does once its worker took the request, so
    # that when the first token comes only its event crosses the router (preparing the client's
    # response at that moment cost ~0.5 ms of TTFT).
    prefill_opened: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    prefill_sent_ms: float | None = None          # arrival -> the prefill leg sent
    first_received_ms: float | None = None        # arrival -> the prefill's first token here
    created: int = field(default_factory=P.now)   # every chunk's `created`, whichever worker makes it
    migrations: list[dict] = field(default_factory=list)   # decode workers the stream moved away from, and why
    first_from_prefill: bool = False              # the client's first token came from the prefill's answer
    # A failure that ended the decode leg from outside (vLLM push: the prefill failed, its decode leg
    # was closed): what a retry names instead of the closed connection.
    cause: BaseException | None = None
    continuation: tuple[int, int] | None = None   # a migration's (tokens sent, characters): events() reshapes

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

    @property
    def first_sent(self) -> bool:
        """The client has a token."""
        return self.first_token_ms is not None

    def next_attempt(self) -> None:
        """Forget the abandoned attempt's legs: the retry is a new handoff with its own id."""
        self.attempts += 1
        self.handoff_id = uuid.uuid4().hex
        self.prefill = self.decode = self.prefill_task = self.remote = self.merged = self.decode_task = None
        self.upstream, self.open_legs, self.holding = [], set(), []
        self.retried, self.kv_source = None, "retried_colocated"
        self.binding, self.rebound_from, self.route_decision = 0, None, None
        if not self.first_token.done():
            self.first_token.set_result(None)
        self.first_token = asyncio.get_running_loop().create_future()
        self.first_relayed = asyncio.Event()
        self.prefill_opened = asyncio.get_running_loop().create_future()
        self.prefill_sent_ms = self.first_received_ms = None
        self.phase = Phase.OPENING

    async def answerable(self, opened: asyncio.Future | None = None) -> None:
        """Until the client can be answered: a stream once the first token is here (or, without one,
        once the decode worker's answer opened, or `opened` is done), a whole answer once the decode
        answer opened. A leg that failed first raises."""
        if self.stream:
            watched = {self.first_token, self.decode_task} | ({opened} if opened is not None else set())
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if self.first_token.done() and self.first_token.result() is not None:
                return
            if opened is not None and opened.done() and not self.decode_task.done():
                return
        await self.decode_task

    # -- what the protocols' router legs call (router/legs.py) -------------------------------------
    def pick(self, role: Role, prefer: str | None = None) -> Worker:
        pool = self.router.pool
        among = pool.candidates(role, self.facts if role == Role.PREFILL else None, prefer)
        estimates = self.reuse_estimates(among) if role == Role.PREFILL else None
        cost = (lambda w: estimates[w.url]["est_ms"] if w.url in estimates else math.inf) if estimates else None
        worker = pool.pick(role, self.excluded, prefer, self.facts, cost, among)
        if estimates:
            self.route_decision = {"choice": estimates[worker.url]["option"], "prefill_worker": worker.url,
                                   "candidates": list(estimates.values())}
        self.holding.append(worker)
        return worker

    @property
    def history_worker(self) -> str | None:
        """Bidirectional: the decode worker holding the conversation's history, preferred."""
        return self.candidate.decode_url if self.candidate is not None else None

    async def open_decode(self, **extra) -> Answer:
        """Send the decode leg; returns its open answer (status line read)."""
        self.decode_sent_ms = self.ms()
        resp = await self.post(self.decode, self.worker_body(Role.DECODE, **extra))
        self.phase = Phase.ANSWERING
        return resp

    def may_retry_colocated(self, failure: BaseException) -> bool:
        """A prefill failure the decode worker could make good by computing the request itself: the
        worker's fault (5xx, unreachable, died), not the request's (4xx would fail there too)."""
        return self.config.retry_colocated and status_of(failure) >= 500

    async def retry_colocated(self, failure: BaseException) -> Answer:
        """Send the client's request, as it came, to the decode worker: it computes it colocated."""
        reason = failure_message(failure)
        log.warning("handoff %s: prefill failed (%s); retrying colocated", self.handoff_id, reason)
        return await self.run_colocated(f"prefill failed ({reason})", "retried_colocated")

    async def run_colocated(self, why: str, kv_source: str) -> Answer:
        """The client's request, as it came, to a decode worker, which computes it itself."""
        if self.decode is None:
            self.decode = self.pick(Role.DECODE)
        self.retried, self.kv_source = f"{why}; computed colocated on {self.decode.url}", kv_source
        self.remote = None                  # nothing pinned to release
        self.decode_sent_ms = self.ms()
        resp = await self.post(self.decode, self.worker_body(Role.DECODE, colocated=True))
        self.phase = Phase.ANSWERING
        return resp

    def refused(self, failure: BaseException | None) -> bool:
        return refused(failure)

    def abandon(self, role: Role) -> None:
        """This leg's answer was closed unread: the worker frees what it holds for it."""
        self.open_legs.discard(role)
        self.tell(self.decode if role == Role.DECODE else self.prefill, "/kv/cancel")

    # -- what an engine's attempt says to its workers (native.py: ours; vllm.py: vLLM's) --------------
    def worker_body(self, role: Role, **extra) -> dict:
        """A leg's request body: the client's, with what this engine's workers need to hand off."""
        raise NotImplementedError

    async def run_prefill(self, **extra):
        """Run the prefill leg to its end; returns the prefill's answer, typed. Its first token resolves
        `first_token` as soon as it is here."""
        raise NotImplementedError

    async def resume_on(self, worker: Worker, token_ids: list[int], emitted_chars: int) -> Answer:
        """Migration: the client's request to `worker` (picked: held), continued after the tokens it
        was sent (computed from the prompt if none)."""
        raise NotImplementedError

    def report_prefill_failure(self, failure: BaseException) -> None:
        """Push: the prefill leg failed with both legs out; the decode side must not wait for its KV."""
        raise NotImplementedError

    async def merge(self, decode_handoff: dict | None) -> M.ClientHandoff:
        """The client's handoff object, merged once (the final chunk and the usage chunk both carry it)."""
        raise NotImplementedError

    async def prefill_outcome(self, known):
        """(the prefill's answer, why it is missing) for the merge: `known` when its leg was awaited
        (pull), else push's prefill task's outcome, waited for up to PREFILL_ANSWER_GRACE_S."""
        if self.prefill_task is None:
            return known, None
        await asyncio.wait({self.prefill_task}, timeout=PREFILL_ANSWER_GRACE_S)
        return task_outcome(self.prefill_task)

    def reuse_estimates(self, among: list[Worker]) -> dict[str, dict] | None:
        """Each prefill worker's cheapest way into a conversation's history, where the engine prices it."""
        return None

    # -- talking to workers ---------------------------------------------------------------------------
    def headers(self) -> dict | None:
        """Headers of every leg's request beyond the router's own (an engine's request id)."""
        return None

    def events(self, resp: Answer):
        """A decode answer's SSE events, each as its lines (the relay reads them)."""
        return sse_events(resp)

    def blame(self, failure: BaseException) -> BaseException:
        """The failure a retry names: the one that closed the decode leg from outside, if any."""
        cause, self.cause = self.cause, None
        return cause or failure

    async def post(self, worker: Worker, body: dict, endpoint: str | None = None) -> Answer:
        """POST and return the open 200 answer (body unread); any other answer raises Relay/APIError."""
        if self.router_ms is None:
            self.router_ms = self.ms()
        self.open_legs.add(worker.role)
        try:
            resp = await self.router.upstream.open("POST", worker.url + (endpoint or self.endpoint), body,
                                                   headers=self.headers())
        except UpstreamError as e:
            if isinstance(e, Unreachable):
                self.open_legs.discard(worker.role)        # it never saw the request
            raise worker_failure(worker, e) from None
        self.upstream.append(resp)
        if resp.status != 200:
            body = await error_json(worker, resp)
            self.open_legs.discard(worker.role)            # it answered: it holds nothing for us
            raise Relay(worker, resp.status, body, resp.retry_after)
        return resp

    async def read_json(self, worker: Worker, resp: Answer) -> dict:
        try:
            data = json.loads(await resp.read())
        except UpstreamError as e:
            raise worker_failure(worker, e) from None
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise WorkerFailure(worker, f"the {worker} answered something that is not a JSON object",
                                "bad_worker_answer")
        return data

    def tell(self, worker: Worker, path: str) -> None:
        """Fire-and-forget /kv/cancel or /kv/release about this handoff. Both are idempotent on the
        worker, so telling a worker that already knows costs nothing."""
        self.router.tell(worker, path, M.HandoffRef(handoff_id=self.handoff_id))

    def unhold(self, worker: Worker) -> None:
        if worker in self.holding:
            self.holding.remove(worker)
            self.router.pool.release(worker, self.facts)

    async def release_legs(self, drained: bool = False) -> None:
        """Close this attempt's upstream answers and tell its workers to free what they hold for it
        (`drained`: the decode answer was read to its end)."""
        for resp in self.upstream:
            resp.close()
        if self.decode_task is not None and not self.decode_task.done():
            self.decode_task.cancel()
        if self.decode_task is not None:
            self.decode_task.add_done_callback(task_outcome)    # consume its exception: no warning
        if self.prefill_task is not None:
            if not self.prefill_task.done():
                self.prefill_task.cancel()      # closes its connection: prefill aborts, frees its blocks
            self.prefill_task.add_done_callback(task_outcome)   # consume its exception: no warning
        for worker in list(self.holding):
            self.unhold(worker)
        # A worker handling a request does not notice that the router hung up until it next writes to
        # us (a prefill waiting for its engine, a decode waiting for KV): tell it, so it frees blocks now.
        if Role.PREFILL in self.open_legs:
            self.tell(self.prefill, "/kv/cancel")
        elif self.remote is not None and not drained:
            self.tell(self.prefill, "/kv/release")    # pull: nobody will read the pinned blocks
        if Role.DECODE in self.open_legs:
            self.tell(self.decode, "/kv/cancel")

    # -- what the client gets -------------------------------------------------------------------------
    def retried_handoff(self) -> M.ClientHandoff:
        """The handoff object of a request computed colocated (the decode worker answered a plain one):
        `kv_source` says why, and the field of that name how."""
        if self.merged is None:
            self.merged = M.ClientHandoff(
                self.handoff_id, self.mode, self.prefill.url if self.prefill else None, self.decode.url,
                dict.fromkeys(M.PHASES), self.router_ms, kv_source=self.kv_source, bytes_transferred=0, blocks=0,
                reused_tokens=0, retried_elsewhere=self.retry_reason, migrated=self.migrations or None)
            setattr(self.merged, self.kv_source, self.retried)
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
        elif self.first_received_ms is not None:        # (a whole answer: the prefill's first token)
            ttft = self.first_received_ms
        elif t.get("ttft_ms") is not None:
            ttft = sent + t["ttft_ms"]
        else:
            ttft = None
        phases = self.merged.phases_ms if self.merged is not None else {}
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
        kept = {"decode_step_ms": t["decode_step_ms"]} if "decode_step_ms" in t else {}     # (the decode worker's own)
        return timings_of(queue, ttft, total) | kept

    def workers_named(self) -> str:
        """The workers of the current attempt, for a log line."""
        named = [str(w) for w in (self.prefill, self.decode) if w is not None]
        return " and ".join(named) or "no worker yet"


def timings_of(queue: float, ttft: float | None, total: float) -> dict:
    """The `timings` object from arrival-relative ms: queue + prefill = ttft, ttft + decode = total."""
    def r(v):
        return None if v is None else round(v, 3)
    return {"queue_ms": r(queue), "prefill_ms": r(None if ttft is None else ttft - queue), "ttft_ms": r(ttft),
            "decode_ms": r(None if ttft is None else total - ttft), "total_ms": r(total)}


def rewrite_final(attempt: Attempt, data: dict, handoff: M.ClientHandoff) -> dict:
    """A final chunk or answer as the client gets it: the merged handoff object and the router's timings."""
    data["handoff"] = handoff.to_dict()
    if "timings" in data:
        data["timings"] = attempt.timings(data.get("timings"))
    return data

