"""The router: an OpenAI-compatible front that sequences a prefill worker and a decode worker per request.

It never touches KV (docs/HANDOFF.md). For every request it chooses one `handoff_id` (used on every
side), picks the workers, forwards the client's body with `kv_transfer_params` added, streams the decode
worker's answer back as it arrives, and merges what both workers report into one `handoff` object.

- pull / pull-reader: prefill first (`stream: false`), then the decode worker is picked (late binding,
  least loaded now) and sent the prefill's handoff object as `remote`.
- push / push-layerwise: the decode worker is picked at arrival (early binding) and both requests go
  out at once; each side is told the other's URL.

Failures: a worker that fails (5xx, unreachable, dies) before the client saw a token is taken out
of rotation (if it stopped answering) and the request is retried once, as a fresh handoff, on other
workers; streams hold back events until the first token so the retry is invisible. After a token, the
stream ends with an OpenAI error event. Nothing outlives --request-timeout.

Ownership of upstream connections: every response opened to a worker is recorded on the request's
`Handoff` and closed by `Router.finish`, whichever way the request ends (done, worker error, client
gone, deadline). Closing a half-read response closes its TCP connection, which is how a worker learns
that nobody listens any more and aborts the request, freeing its blocks.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvhandoff.serve import protocol as P
from kvhandoff.serve.auth import control_headers
from kvhandoff.serve.metrics import CONTENT_TYPE, LATENCY_BUCKETS
from kvhandoff.serve.server import CHAT, COMPLETIONS, SSEResponse, sse_event, wait_disconnect
from kvhandoff.serve.sessions import SessionEntry, SessionMap

log = logging.getLogger("kvhandoff.router")

MODES = ("pull", "pull-reader", "push", "push-layerwise")
PHASES = ("prefill_queue", "prefill_compute", "handoff_wait", "transfer", "decode_queue", "first_step")
# Fields of the prefill's handoff object worth showing the client when the decode side lacks them;
# the rest (token ids, block ids, checksums, agent metadata) is protocol payload, not observability.
PREFILL_FALLBACK_FIELDS = ("bytes_transferred", "blocks", "reused_tokens", "reverse_bytes", "reuse_decision")
SESSION_HEADER = "x-session-id"
DONE = "data: [DONE]\n\n"
# Push: how long the decode side's final answer waits for the prefill's (normally there already: the
# prefill answers once its WRITE is done, before decode can finish). Bounded, so a prefill that hangs
# delays nobody's last chunk by more than this.
PREFILL_ANSWER_GRACE_S = 5.0


def parse_urls(spec: str) -> list[str]:
    """'h:p,http://h2:p2/v1/' -> ['http://h:p', 'http://h2:p2']: workers are named by their base URL."""
    urls = []
    for raw in spec.split(","):
        url = raw.strip().rstrip("/")
        if not url:
            continue
        url = url.removesuffix("/v1")
        urls.append(url if "://" in url else f"http://{url}")
    if not urls:
        raise ValueError(f"no worker URL in {spec!r}")
    return urls


@dataclass
class RouterConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    mode: str
    secret: bytes
    request_timeout: float = 600.0        # whole-request deadline, streams included
    connect_timeout: float = 5.0
    health_interval: float = 1.0          # seconds between /health polls of every worker; 0 = never
    # A prefill leg that fails (5xx, or the worker cannot be reached or dies) before the decode answer
    # started is retried as a plain request on the decode worker, which then computes it colocated;
    # after the answer started the decode worker is told to recompute. Off: the client gets the error
    # (pull) or the decode worker's --kv-load-failure-policy decides (push).
    retry_colocated: bool = False
    # Bidirectional reuse: decode workers keep each finished turn's KV, this router remembers where
    # (sessions.py), and the next turn's prefill reads it back instead of recomputing the history.
    bidirectional: bool = False

    def __post_init__(self):
        assert self.mode in MODES, f"mode must be one of {MODES}, got {self.mode!r}"
        assert self.prefill_urls and self.decode_urls, "the router needs a prefill and a decode worker"
        assert self.secret, "the router needs the deployment secret to talk to its workers"


@dataclass
class Worker:
    url: str
    role: str                    # "prefill" or "decode"
    in_flight: int = 0           # requests this router has routed to it and not yet finished
    load: int = 0                # num_running + num_waiting at its last /health
    healthy: bool = True         # until a poll says otherwise
    last_health: dict = field(default_factory=dict)

    def __str__(self) -> str:         # how messages and logs name it
        return f"{self.role} worker {self.url}"


class WorkerFailure(P.APIError):
    """A worker could not be reached, broke off its answer, or answered garbage (502)."""

    def __init__(self, worker: Worker, message: str, code: str):
        super().__init__(502, message, type="server_error", code=code)
        self.worker = worker


class Relay(Exception):
    """A worker's own error answer (4xx/5xx), relayed to the client with its status and body."""

    def __init__(self, worker: Worker, status: int, body: dict, retry_after: str | None = None):
        super().__init__(f"{worker} answered {status}")
        self.worker, self.status, self.body, self.retry_after = worker, status, body, retry_after


@dataclass
class Handoff:
    """One client request on its way through the router."""
    handoff_id: str
    endpoint: str
    stream: bool
    t0: float                                     # perf_counter at arrival
    deadline: float                               # event-loop time after which the router gives up
    router_ms: float | None = None                # arrival -> first byte sent to a worker
    prefill: Worker | None = None
    decode: Worker | None = None
    prefill_task: asyncio.Task | None = None      # resolves to the prefill's handoff object
    remote: dict | None = None                    # pull: the prefill's handoff object (blocks pinned)
    upstream: list[httpx.Response] = field(default_factory=list)
    open_legs: set[str] = field(default_factory=set)      # roles sent a request whose answer we lack
    holding: list[Worker] = field(default_factory=list)   # in_flight counted on these
    status: str = "200"                           # metrics label of the outcome
    decode_done: bool = False                     # the decode worker's answer was read to the end
    first_token_ms: float | None = None           # streams: when the first generated text went out
    decode_opened: bool = False                   # the decode worker's answer has started (status line read)
    retried: str | None = None                    # why the request was retried colocated on the decode worker
    session_id: str | None = None                 # bidirectional: the client's name for the conversation
    candidate: SessionEntry | None = None         # bidirectional: where its history's KV is kept
    finished: bool = False
    attempts: int = 1                             # 2 after a retry on other workers
    excluded: set[str] = field(default_factory=set)   # workers that failed this request
    retry_reason: str | None = None               # why the first attempt was given up

    def next_attempt(self) -> None:
        """Forget the abandoned attempt's legs: the retry is a new handoff with its own id."""
        self.attempts += 1
        self.handoff_id = uuid.uuid4().hex
        self.prefill = self.decode = self.prefill_task = self.remote = None
        self.upstream, self.open_legs, self.holding = [], set(), []
        self.decode_done = self.decode_opened = False
        self.retried = None

    def ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3


class RouterMetrics:
    """The router's own registry: what the client saw, per mode, plus the merged handoff phases."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvhandoff_router_requests", "Requests by mode, endpoint and outcome "
                                "(HTTP status; 499 client gone; stream_error)", ["mode", "endpoint", "status"],
                                registry=r)
        self.ttft = Histogram("kvhandoff_router_time_to_first_token_seconds",
                              "Arrival at the router to the first token forwarded (streams)", ["mode"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvhandoff_router_e2e_request_latency_seconds",
                             "Arrival at the router to the end of the answer (successful requests)", ["mode"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.phase = Histogram("kvhandoff_router_handoff_phase_seconds",
                               "Per-phase time from the merged handoff objects (router = router_ms)",
                               ["mode", "phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.bytes = Counter("kvhandoff_router_handoff_bytes", "KV bytes the workers reported moving", ["mode"],
                             registry=r)
        self.retries = Counter("kvhandoff_router_retries", "Requests retried once on other workers after a "
                               "worker failed them before their first token, by the failed worker's role",
                               ["mode", "role"], registry=r)
        self.in_flight = Gauge("kvhandoff_router_worker_in_flight", "Requests in flight per worker",
                               ["role", "worker"], registry=r)

    def handoff(self, mode: str, merged: dict) -> None:
        for phase, ms in (merged.get("phases_ms") or {}).items():
            if isinstance(ms, (int, float)):
                self.phase.labels(mode, phase).observe(ms / 1e3)
        if isinstance(merged.get("router_ms"), (int, float)):
            self.phase.labels(mode, "router").observe(merged["router_ms"] / 1e3)
        if isinstance(merged.get("bytes_transferred"), int):
            self.bytes.labels(mode).inc(merged["bytes_transferred"])


class Router:
    def __init__(self, config: RouterConfig):
        self.config, self.mode = config, config.mode
        self.prefills = [Worker(u, "prefill") for u in config.prefill_urls]
        self.decodes = [Worker(u, "decode") for u in config.decode_urls]
        self.auth = control_headers(config.secret)
        self.metrics = RouterMetrics()
        self.cursor: dict[str, int] = {}              # per role: where the round-robin tie break resumes
        self.client: httpx.AsyncClient | None = None
        self.background: set[asyncio.Task] = set()   # health polls, control messages, stream cleanups
        self.num_in_flight = 0                        # client requests not finished yet
        self.sessions = SessionMap()
        self.last_sweep = 0.0

    @property
    def workers(self) -> list[Worker]:
        return self.prefills + self.decodes

    async def start(self) -> None:
        # No read timeout: a long prefill or a long generation is not a failure; the request deadline
        # (config.request_timeout) bounds everything instead. No pool cap: in-flight requests are bounded
        # by the workers' queues, and a router that queued on its own pool would hide load from them.
        # Idle connections are dropped well before the workers would close them (SERVER_KEEP_ALIVE_S).
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=self.config.connect_timeout, read=None, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=5.0))
        logging.getLogger("httpx").setLevel(logging.WARNING)   # not a line per worker call and health poll
        if self.config.health_interval > 0:
            self.spawn(self.poll_health())

    async def stop(self) -> None:
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.client.aclose()

    def spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # -- worker choice --------------------------------------------------------------------------------
    def pick(self, ctx: Handoff, workers: list[Worker], prefer: str | None = None) -> Worker:
        """Least loaded: healthy first, then fewest in flight from this router, then the load the worker
        last reported; ties go round-robin (the first tied one after the last pick) so equals share.
        A healthy `prefer` (the decode worker holding the conversation's history) wins outright."""
        role, n = workers[0].role, len(workers)
        start = self.cursor.get(role, 0)
        in_turn = [workers[(start + i) % n] for i in range(n)]
        worker = min(in_turn, key=lambda w: (w.url in ctx.excluded, not w.healthy, w.url != prefer,
                                             w.in_flight, w.load))
        self.cursor[role] = (workers.index(worker) + 1) % n
        worker.in_flight += 1
        ctx.holding.append(worker)
        self.metrics.in_flight.labels(worker.role, worker.url).set(worker.in_flight)
        return worker

    def unhold(self, ctx: Handoff, worker: Worker) -> None:
        if worker in ctx.holding:
            ctx.holding.remove(worker)
            worker.in_flight -= 1
            self.metrics.in_flight.labels(worker.role, worker.url).set(worker.in_flight)

    # -- talking to workers ---------------------------------------------------------------------------
    def worker_body(self, ctx: Handoff, body: dict, role: str, **extra) -> dict:
        params = {"handoff_id": ctx.handoff_id, "mode": self.mode, "role": role, **extra}
        if self.config.bidirectional and role == "prefill" and ctx.candidate is not None:
            params["reuse"] = ctx.candidate.candidate()
        if self.config.bidirectional and role == "decode":
            params["retain"] = True
            if ctx.candidate is not None and ctx.candidate.decode_url == ctx.decode.url:
                params["supersedes"] = ctx.candidate.retention_id
        if role == "prefill":   # prefill answers one JSON object, whatever the client asked for
            body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        return {**body, "kv_transfer_params": params}

    async def post(self, ctx: Handoff, worker: Worker, path: str, body: dict) -> httpx.Response:
        """POST and return the open 200 response (body unread); any other answer raises Relay/APIError."""
        request = self.client.build_request("POST", worker.url + path, json=body, headers=self.auth)
        if ctx.router_ms is None:
            ctx.router_ms = round(ctx.ms(), 3)
        ctx.open_legs.add(worker.role)
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.TransportError as e:
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                ctx.open_legs.discard(worker.role)        # it never saw the request
            raise worker_failure(worker, e) from None
        ctx.upstream.append(resp)
        if resp.status_code != 200:
            body = await error_json(worker, resp)
            ctx.open_legs.discard(worker.role)            # it answered: it holds nothing for us
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
            raise WorkerFailure(worker, f"the {worker} answered something that is not "
                                "a JSON object", "bad_worker_answer")
        return data

    async def call_prefill(self, ctx: Handoff, endpoint: str, body: dict, **extra) -> dict:
        """Run the prefill leg to its end; returns the prefill's handoff object."""
        worker = ctx.prefill
        resp = await self.post(ctx, worker, endpoint, self.worker_body(ctx, body, "prefill", **extra))
        data = await self.read_json(worker, resp)
        ctx.open_legs.discard("prefill")
        self.unhold(ctx, worker)
        handoff = data.get("handoff")
        if not isinstance(handoff, dict):
            raise WorkerFailure(worker, f"the prefill worker {worker.url} answered without a handoff object; is "
                                "it running with --role prefill?", "bad_worker_answer")
        return handoff

    def tell(self, ctx: Handoff, worker: Worker, path: str, **fields) -> None:
        """Fire-and-forget control message about this handoff (/kv/cancel, /kv/release, /kv/failed).
        All are idempotent on the worker, so telling a worker that already knows costs nothing."""
        handoff_id = ctx.handoff_id         # now: a retry gives ctx a new one before this runs
        async def send():
            try:
                await self.client.post(worker.url + path, json={"handoff_id": handoff_id, **fields},
                                       headers=self.auth, timeout=5.0)
            except httpx.HTTPError as e:     # a worker known to be down: expected, not worth a warning each
                log.log(logging.WARNING if worker.healthy else logging.INFO, "handoff %s: %s on %s failed: %s",
                        handoff_id, path, worker.url, describe(e))
        self.spawn(send())

    # -- one request ----------------------------------------------------------------------------------
    async def dispatch(self, ctx: Handoff, body: dict) -> Response:
        """The client's response: a stream relayed from the decode worker, or its whole JSON answer."""
        if self.config.bidirectional:
            ctx.candidate = await self.find_session(ctx, body)
        while True:
            try:
                resp = await self.open_answer(ctx, body)
                if ctx.stream:
                    # finish() awaits (closing upstream), and SSEResponse calls on_close synchronously once
                    # the response is over, outside the cancel scope Starlette ends a stream with: a task.
                    return SSEResponse(self.relay_events(ctx, body, resp), on_close=lambda: self.spawn(self.finish(ctx)))
                data = await self.read_json(ctx.decode, resp)
                break
            except (Relay, P.APIError) as failure:
                if not await self.retry_elsewhere(ctx, failure):
                    raise
        ctx.decode_done = True
        ctx.open_legs.discard("decode")
        if ctx.retried:
            data["handoff"] = self.retried_handoff(ctx)
        elif isinstance(data.get("handoff"), dict):
            data["handoff"] = await self.merge(ctx, data["handoff"])
        return JSONResponse(data)

    async def retry_elsewhere(self, ctx: Handoff, failure: BaseException) -> bool:
        """A worker failed this request before the client saw any of its answer: give up this attempt
        (its legs released as if the client had left) and say whether to try once more, on workers
        other than the failed one. Only the worker's fault qualifies (5xx, unreachable, died), and only
        when a healthy alternative exists: the same worker would most likely fail the same way.
        The retry avoids both workers of the failed attempt where it can."""
        worker = failure.worker if isinstance(failure, (Relay, WorkerFailure)) else None
        status = failure.status if isinstance(failure, (Relay, P.APIError)) else 500
        if isinstance(failure, WorkerFailure) and failure.code != "bad_worker_answer" and self.config.health_interval > 0:
            worker.healthy = False          # it stopped answering: out of rotation until a poll says ok
        if worker is None or status < 500 or ctx.attempts > 1 or ctx.first_token_ms is not None:
            return False
        peers = self.prefills if worker.role == "prefill" else self.decodes
        if not any(w.healthy and w is not worker for w in peers):
            return False
        reason = failure_message(failure)
        log.warning("handoff %s: %s; retrying once on other workers", ctx.handoff_id, reason)
        self.metrics.retries.labels(self.mode, worker.role).inc()
        await self.release_legs(ctx)
        # Both of the attempt's workers, not just the one that answered the error: a decode worker's
        # 502 may be about its prefill peer ("prefill worker ... unreachable"). Exclusion only orders
        # the choice, so a role with no other worker still gets one.
        ctx.excluded |= {w.url for w in (ctx.prefill, ctx.decode, worker) if w is not None}
        ctx.retry_reason = reason
        ctx.next_attempt()
        return True

    async def open_answer(self, ctx: Handoff, body: dict) -> httpx.Response:
        """Everything up to the answer's status line: both legs started, the decode answer open."""
        prefer = ctx.candidate.decode_url if ctx.candidate is not None else None
        if self.mode.startswith("pull"):
            ctx.prefill = self.pick(ctx, self.prefills)
            try:
                ctx.remote = await self.call_prefill(ctx, ctx.endpoint, body)
            except (Relay, P.APIError) as e:
                if not self.may_retry(e):
                    raise
                resp = await self.retry_colocated(ctx, body, e)
            else:
                ctx.decode = self.pick(ctx, self.decodes, prefer)    # late binding: load as it is now
                resp = await self.post(ctx, ctx.decode, ctx.endpoint,
                                       self.worker_body(ctx, body, "decode", remote=ctx.remote))
            ctx.decode_opened = True
        else:
            ctx.decode = self.pick(ctx, self.decodes, prefer)    # early binding: at arrival
            ctx.prefill = self.pick(ctx, self.prefills)
            ctx.prefill_task = asyncio.ensure_future(
                self.call_prefill(ctx, ctx.endpoint, body, decode_url=ctx.decode.url))
            ctx.prefill_task.add_done_callback(lambda task: self.push_prefill_done(ctx, task))
            resp = await self.open_push_decode(ctx, body)
        return resp

    async def open_push_decode(self, ctx: Handoff, body: dict) -> httpx.Response:
        decode = asyncio.ensure_future(self.post(ctx, ctx.decode, ctx.endpoint,
                                                 self.worker_body(ctx, body, "decode", prefill_url=ctx.prefill.url)))
        try:
            await asyncio.wait({ctx.prefill_task, decode}, return_when=asyncio.FIRST_COMPLETED)
            # Before the decode answer starts, a prefill that refused the request (4xx) or cannot be
            # reached ends it: the decode side would only wait for KV that never comes. Later (or on a
            # 5xx) the decode worker hears of it (protocol or /kv/failed) and recomputes or fails by policy.
            failure = None if decode.done() else task_error(ctx.prefill_task)
            if failure is not None and self.may_retry(failure):
                decode.cancel()                # closes the leg: the decode worker drops its reservation
                await asyncio.wait({decode})
                ctx.open_legs.discard("decode")
                self.tell(ctx, ctx.decode, "/kv/cancel")
                return await self.retry_colocated(ctx, body, failure)
            if failure is not None and prefill_refused(ctx.prefill_task):
                raise failure
            resp = await decode
            ctx.decode_opened = True
            return resp
        finally:
            if not decode.done():
                decode.cancel()
                await asyncio.wait({decode})

    def push_prefill_done(self, ctx: Handoff, task: asyncio.Task) -> None:
        """Push: a prefill that failed once both legs were out (a 5xx, or its connection broke) is
        reported to decode at once (/kv/failed), which recomputes or fails by its policy (recomputes,
        with retry_colocated) instead of waiting out --kv-timeout-s. A refusal (4xx, unreachable) ends
        the whole request, and a failure the router will retry colocated is open_push_decode's; a
        cancelled prefill is the router's own doing."""
        failure = task_error(task)
        if ctx.finished or task is not ctx.prefill_task or failure is None or prefill_refused(task):
            return      # (not ctx.prefill_task: an attempt given up for a retry, already cleaned up)
        if self.may_retry(failure) and not ctx.decode_opened:
            return
        _, reason = task_outcome(task)
        fields = {"recompute": True} if self.config.retry_colocated else {}
        self.tell(ctx, ctx.decode, "/kv/failed", reason=f"prefill worker {ctx.prefill.url}: {reason}",
                  prefill_answered=isinstance(failure, Relay), **fields)

    def may_retry(self, failure: BaseException) -> bool:
        """A prefill failure the decode worker could make good by computing the request itself: the
        worker's fault (5xx, unreachable, died), not the request's (4xx would fail there too)."""
        status = failure.status if isinstance(failure, (Relay, P.APIError)) else 500
        return self.config.retry_colocated and status >= 500

    async def retry_colocated(self, ctx: Handoff, body: dict, failure: BaseException) -> httpx.Response:
        """Send the client's request, as it came, to the decode worker: it computes it colocated."""
        reason = failure_message(failure)
        log.warning("handoff %s: prefill failed (%s); retrying colocated", ctx.handoff_id, reason)
        if ctx.decode is None:
            ctx.decode = self.pick(ctx, self.decodes)
        ctx.retried = f"prefill failed ({reason}); computed colocated on {ctx.decode.url}"
        ctx.remote = None                  # nothing pinned to release
        return await self.post(ctx, ctx.decode, ctx.endpoint, body)

    def retried_handoff(self, ctx: Handoff) -> dict:
        """The handoff object of a request retried colocated (the decode worker answered a plain one)."""
        report = {"handoff_id": ctx.handoff_id, "mode": self.mode, "prefill_worker": ctx.prefill.url,
                  "decode_worker": ctx.decode.url, "bytes_transferred": 0, "blocks": 0, "reused_tokens": 0,
                  "kv_source": "retried_colocated", "retried_colocated": ctx.retried,
                  "phases_ms": dict.fromkeys(PHASES), "router_ms": ctx.router_ms}
        return report | ({"retried_elsewhere": ctx.retry_reason} if ctx.retry_reason else {})

    async def merge(self, ctx: Handoff, decode_handoff: dict) -> dict:
        """The client's handoff object: the decode worker's, with the prefill's phases and ours added."""
        prefill, prefill_error = ctx.remote, None
        if ctx.prefill_task is not None:      # push
            await asyncio.wait({ctx.prefill_task}, timeout=PREFILL_ANSWER_GRACE_S)
            prefill, prefill_error = task_outcome(ctx.prefill_task)
        prefill = prefill or {}
        pre, dec = prefill.get("phases_ms") or {}, decode_handoff.get("phases_ms") or {}
        # handoff_wait and transfer may come from both sides; the one that moved the data (decode READs
        # in pull, prefill WRITEs in push) measured the transfer itself, so its view wins.
        first, second = (pre, dec) if self.mode.startswith("push") else (dec, pre)
        phases = {p: first.get(p) if first.get(p) is not None else second.get(p) for p in PHASES}
        merged = {**decode_handoff}
        for name in PREFILL_FALLBACK_FIELDS:
            if merged.get(name) is None and prefill.get(name) is not None:
                merged[name] = prefill[name]
        merged.update(handoff_id=ctx.handoff_id, mode=self.mode, prefill_worker=ctx.prefill.url,
                      decode_worker=ctx.decode.url, phases_ms=phases, router_ms=ctx.router_ms)
        if prefill_error:
            merged["prefill_error"] = prefill_error
        if ctx.retry_reason:
            merged["retried_elsewhere"] = ctx.retry_reason
        if self.config.bidirectional:
            self.remember(ctx, merged)
        self.metrics.handoff(self.mode, merged)
        return merged

    async def relay_events(self, ctx: Handoff, body: dict, resp: httpx.Response) -> AsyncIterator[str]:
        """The decode worker's SSE events, forwarded as they arrive; the event that carries the handoff
        object is re-encoded with the merged one. Events before the first token (a chat stream's role
        announcement) are held back with it, so that a worker failing before then can be replaced
        (retry_elsewhere) without the client seeing two beginnings. A failure after it, or the deadline,
        ends the stream with an OpenAI error event, as a worker's own stream would."""
        events, held = sse_events(resp), []
        while True:
            try:
                async with asyncio.timeout_at(ctx.deadline):
                    lines = await anext(events, None)
            except TimeoutError:
                ctx.status = "504"
                log.warning("handoff %s: the stream did not end within --request-timeout %g s (%s)",
                            ctx.handoff_id, self.config.request_timeout, attempt_workers(ctx))
                yield "".join(held) + sse_event(deadline_error(self.config.request_timeout).body()) + DONE
                return
            except httpx.TransportError as e:
                failure = worker_failure(ctx.decode, e)
                try:
                    if await self.retry_elsewhere(ctx, failure):
                        async with asyncio.timeout_at(ctx.deadline):
                            resp = await self.open_answer(ctx, body)
                        events, held = sse_events(resp), []
                        continue
                except (Relay, P.APIError) as e2:
                    failure = e2
                except TimeoutError:
                    failure = deadline_error(self.config.request_timeout)
                ctx.status = str(getattr(failure, "status", 502))
                message = failure_message(failure)
                if ctx.retry_reason:
                    message += f" (retried after: {ctx.retry_reason})"
                yield "".join(held) + sse_event(P.error_body(message, "server_error")) + DONE
                return
            if lines is None:
                ctx.decode_done = True
                ctx.open_legs.discard("decode")
                if held:
                    yield "".join(held)
                return
            event = await self.rewrite_event(ctx, lines)
            if ctx.first_token_ms is None and ctx.status == "200":
                held.append(event)
                continue
            yield "".join(held) + event
            held = []

    async def rewrite_event(self, ctx: Handoff, lines: list[str]) -> str:
        raw = "\n".join(lines) + "\n\n"
        payload = lines[0][5:].strip() if len(lines) == 1 and lines[0].startswith("data:") else None
        if not payload or payload == "[DONE]":
            return raw
        try:
            chunk = json.loads(payload)
        except ValueError:
            return raw
        if not isinstance(chunk, dict):
            return raw
        if "error" in chunk:
            ctx.status = "stream_error"
        if ctx.first_token_ms is None and has_token(chunk):
            ctx.first_token_ms = ctx.ms()
            self.metrics.ttft.labels(self.mode).observe(ctx.first_token_ms / 1e3)
        if ctx.retried and "timings" in chunk and chunk.get("choices"):   # the final chunk, not the usage one
            chunk["handoff"] = self.retried_handoff(ctx)
            return sse_event(chunk)
        if isinstance(chunk.get("handoff"), dict):
            chunk["handoff"] = await self.merge(ctx, chunk["handoff"])
            return sse_event(chunk)
        return raw

    async def finish(self, ctx: Handoff) -> None:
        """Close whatever is still open for this request and count it; idempotent."""
        if ctx.finished:
            return
        ctx.finished = True
        self.num_in_flight -= 1
        await self.release_legs(ctx)
        status = ctx.status
        if ctx.stream and status == "200" and not ctx.decode_done:
            status = "499"                     # the client left mid-stream
        self.metrics.requests.labels(self.mode, ctx.endpoint, status).inc()
        if status == "200":
            self.metrics.e2e.labels(self.mode).observe(ctx.ms() / 1e3)

    async def release_legs(self, ctx: Handoff) -> None:
        """Close this attempt's upstream answers and tell its workers to free what they hold for it."""
        for resp in ctx.upstream:
            await resp.aclose()
        if ctx.prefill_task is not None:
            if not ctx.prefill_task.done():
                ctx.prefill_task.cancel()      # closes its connection: prefill aborts, frees its blocks
            ctx.prefill_task.add_done_callback(task_outcome)   # consume its exception: no warning
        for worker in list(ctx.holding):
            self.unhold(ctx, worker)
        # A worker handling a request does not notice that the router hung up until it next writes to
        # us (a prefill waiting for its engine, a decode waiting for KV): tell it, so it frees blocks now.
        if "prefill" in ctx.open_legs:
            self.tell(ctx, ctx.prefill, "/kv/cancel")
        elif ctx.remote is not None and not ctx.decode_done:
            self.tell(ctx, ctx.prefill, "/kv/release")    # pull: nobody will read the pinned blocks
        if "decode" in ctx.open_legs:
            self.tell(ctx, ctx.decode, "/kv/cancel")

    # -- bidirectional: the session map ---------------------------------------------------------------
    async def find_session(self, ctx: Handoff, body: dict) -> SessionEntry | None:
        """Where this conversation's history is kept: by the client's session id, else by the longest
        block-hash match of the prompt (its hashes come from a prefill worker, which tokenizes)."""
        now = time.monotonic()
        if now - self.last_sweep > 1.0:
            self.last_sweep = now
            for entry in self.sessions.sweep():
                log.debug("session %s: retained KV expired", entry.key)
        if ctx.session_id is not None:
            return self.sessions.get(ctx.session_id)
        if not len(self.sessions):
            return None
        worker = min(self.prefills, key=lambda w: (not w.healthy, w.in_flight, w.load))
        try:
            resp = await self.client.post(worker.url + "/kv/prompt", headers=self.auth, timeout=10.0,
                                          json={"endpoint": ctx.endpoint, "request": body})
            hashes = resp.json().get("block_hashes") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            log.warning("handoff %s: no prompt hashes from %s (%s): no reuse", ctx.handoff_id, worker.url, e)
            return None
        return self.sessions.match(hashes) if isinstance(hashes, list) else None

    def remember(self, ctx: Handoff, merged: dict) -> None:
        """Record where this turn's KV is kept now; forget (and free) the turn it replaces."""
        retained = merged.get("retained")
        old = ctx.candidate
        if not isinstance(retained, dict) or not isinstance(retained.get("retention_id"), str):
            return                       # not kept (an error, or the worker has no retention): keep the old one
        key = ctx.session_id or f"anon:{retained['retention_id']}"
        if old is not None:
            self.sessions.drop(old.key)
            if old.decode_url != ctx.decode.url:     # superseded on another worker: it can free it now
                holder = next((w for w in self.decodes if w.url == old.decode_url), None)
                if holder is not None:
                    self.tell(ctx, holder, "/kv/retained/release", retention_id=old.retention_id)
        hashes = retained.get("block_hashes") or []
        self.sessions.record(SessionEntry(key, ctx.decode.url, retained["retention_id"],
                                          int(retained.get("num_tokens", 0)), list(hashes),
                                          time.monotonic() + float(retained.get("expires_in_s", 0)),
                                          int(retained.get("bytes", 0))))
        # The client sees where its history is kept, not the hash chain (protocol payload).
        merged["retained"] = {k: v for k, v in retained.items() if k != "block_hashes"} | {"session": key}

    async def handle(self, request: Request, endpoint: str) -> Response:
        loop = asyncio.get_running_loop()
        ctx = Handoff(uuid.uuid4().hex, endpoint, False, time.perf_counter(),
                      loop.time() + self.config.request_timeout)
        self.num_in_flight += 1                       # finish() takes it back, once per request
        try:
            body = await read_json_object(request)
        except P.APIError as e:
            ctx.status = str(e.status)
            await self.finish(ctx)
            return JSONResponse(e.body(), status_code=e.status)
        ctx.stream = bool(body.get("stream"))
        if self.config.bidirectional:
            session_id = request.headers.get(SESSION_HEADER) or body.pop("session_id", None)
            if session_id is not None and not (isinstance(session_id, str) and 0 < len(session_id) <= 256):
                await self.finish(ctx)
                err = P.APIError(400, "session_id must be a non-empty string of at most 256 characters",
                                 param="session_id")
                return JSONResponse(err.body(), status_code=400)
            ctx.session_id = session_id
        work = asyncio.ensure_future(self.dispatch(ctx, body))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, timeout=self.config.request_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.wait({work})
        response = self.outcome(ctx, work, client_gone=gone.done() and not gone.cancelled())
        if not isinstance(response, SSEResponse):     # a stream finishes when its body ends
            await self.finish(ctx)
        return response

    def outcome(self, ctx: Handoff, work: asyncio.Task, client_gone: bool) -> Response:
        if work.cancelled():
            if client_gone:
                ctx.status = "499"
                return Response(status_code=499)   # nobody is listening; nginx's "client closed request"
            err = deadline_error(self.config.request_timeout)
        else:
            err = work.exception()
            if err is None:
                return work.result()
        if isinstance(err, Relay):
            ctx.status = str(err.status)
            headers = {"Retry-After": err.retry_after} if err.retry_after else None   # a worker's backpressure
            return JSONResponse(err.body, status_code=err.status, headers=headers)
        if not isinstance(err, P.APIError):
            log.error("handoff %s failed in the router", ctx.handoff_id, exc_info=err)
            err = P.APIError(500, "internal router error; see the router log")
        elif err.status >= 500:
            log.warning("handoff %s: %s (%s)", ctx.handoff_id, err.message, attempt_workers(ctx))
        ctx.status = str(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    # -- health and models ----------------------------------------------------------------------------
    async def check(self, worker: Worker) -> dict:
        try:
            resp = await self.client.get(worker.url + "/health", headers=self.auth, timeout=2.0)
            data = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
            worker.healthy = resp.status_code == 200
            worker.last_health = data if isinstance(data, dict) else {}
            worker.load = int(worker.last_health.get("num_running", 0)) + int(worker.last_health.get("num_waiting", 0))
            status = {"status": "ok" if worker.healthy else "error", **worker.last_health}
        except (httpx.HTTPError, ValueError, TypeError) as e:   # TypeError: counts that are not numbers
            worker.healthy = False
            status = {"status": "unreachable", "error": describe(e)}
        return {**status, "url": worker.url, "role": worker.role, "in_flight": worker.in_flight}

    async def poll_health(self) -> None:
        while True:
            await asyncio.gather(*(self.check(w) for w in self.workers))
            await asyncio.sleep(self.config.health_interval)

    async def health(self) -> JSONResponse:
        reports = await asyncio.gather(*(self.check(w) for w in self.workers))
        missing = [role for role, ws in (("prefill", self.prefills), ("decode", self.decodes))
                   if not any(w.healthy for w in ws)]
        body = {"status": "error" if missing else "ok", "role": "router", "mode": self.mode,
                "num_in_flight": self.num_in_flight, "workers": reports}
        if missing:
            body["error"] = f"no healthy {' or '.join(missing)} worker"
        return JSONResponse(body, status_code=503 if missing else 200)

    async def proxy_get(self, path: str) -> Response:
        """GET from the first worker that answers (decode workers first: they serve the answers)."""
        errors = []
        for worker in self.decodes + self.prefills:
            try:
                resp = await self.client.get(worker.url + path, headers=self.auth, timeout=10.0)
            except httpx.HTTPError as e:
                errors.append(f"{worker.url}: {describe(e)}")
                continue
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))
        err = P.APIError(502, f"no worker answered {path} ({'; '.join(errors)})", type="server_error",
                         code="worker_unreachable")
        return JSONResponse(err.body(), status_code=502)


# ---------------------------------------------------------------------------------------------------
# Helpers

async def sse_events(resp: httpx.Response) -> AsyncIterator[list[str]]:
    """The lines of each SSE event (blank-line separated), yielded as soon as the event is complete."""
    lines: list[str] = []
    async for line in resp.aiter_lines():
        if line:
            lines.append(line)
        elif lines:
            yield lines
            lines = []
    if lines:
        yield lines


def has_token(chunk: dict) -> bool:
    """Does this completion or chat chunk carry generated text (not the role-only opening chunk)?"""
    for choice in chunk.get("choices") or ():
        if isinstance(choice, dict) and (choice.get("text") or (choice.get("delta") or {}).get("content")):
            return True
    return False


async def read_json_object(request: Request) -> dict:
    """The router's only validation: a JSON object without the router-owned field. Workers check the rest."""
    raw = await request.body()
    if not raw.strip():
        raise P.APIError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise P.APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise P.APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    if "kv_transfer_params" in data:
        raise P.APIError(400, "kv_transfer_params is reserved: the router sets it for its workers; remove it "
                         "from the request", param="kv_transfer_params")
    return data


async def error_json(worker: Worker, resp: httpx.Response) -> dict:
    """A worker's error body as OpenAI error JSON: as sent if it is one, wrapped otherwise."""
    try:
        raw = await resp.aread()
    except httpx.TransportError as e:
        raw = f"(body lost: {describe(e)})".encode()
    try:
        data = json.loads(raw)
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return data
    except ValueError:
        pass
    text = raw.decode(errors="replace").strip()[:300]
    return P.error_body(f"the {worker} answered {resp.status_code}: {text}",
                        "invalid_request_error" if resp.status_code < 500 else "server_error")


def worker_failure(worker: Worker, e: httpx.TransportError) -> WorkerFailure:
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return WorkerFailure(worker, f"cannot reach the {worker}: {describe(e)}",
                             "worker_unreachable")
    return WorkerFailure(worker, f"the {worker} failed mid-request: {describe(e)}",
                         "worker_failed")


def failure_message(failure: BaseException) -> str:
    if isinstance(failure, Relay):
        error = failure.body.get("error") if isinstance(failure.body, dict) else None
        detail = error.get("message") if isinstance(error, dict) else None
        return f"{failure}: {detail}" if detail else str(failure)
    return getattr(failure, "message", None) or str(failure)


def attempt_workers(ctx: Handoff) -> str:
    """The workers of the request's current attempt, for a log line."""
    named = [str(w) for w in (ctx.prefill, ctx.decode) if w is not None]
    return " and ".join(named) or "no worker yet"


def deadline_error(seconds: float) -> P.APIError:
    return P.APIError(504, f"the request took longer than the router's --request-timeout of {seconds:g} s",
                      type="server_error", code="request_timeout")


def describe(e: BaseException) -> str:
    return str(e) or type(e).__name__


def prefill_refused(task: asyncio.Task) -> bool:
    """Did the prefill leg end in a way that dooms the request (4xx, unreachable) rather than a 5xx?"""
    e = task_error(task)
    return (isinstance(e, Relay) and e.status < 500) or (isinstance(e, P.APIError) and e.code == "worker_unreachable")


def task_error(task: asyncio.Task) -> BaseException | None:
    """The exception a finished prefill task ended with; None if it is running, cancelled or succeeded."""
    return None if not task.done() or task.cancelled() else task.exception()


def task_outcome(task: asyncio.Task) -> tuple[dict | None, str | None]:
    """(result, None) or (None, what went wrong) for a finished-or-not prefill task."""
    if not task.done():
        return None, "the prefill worker had not answered yet"
    if task.cancelled():
        return None, "cancelled"
    e = task.exception()
    if e is None:
        return task.result(), None
    if isinstance(e, Relay):
        return None, str((e.body.get("error") or {}).get("message") or e)
    return None, getattr(e, "message", None) or describe(e)


# ---------------------------------------------------------------------------------------------------
# App

def build_router_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="kvhandoff router", version="0.1.0", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(P.http_error(request.method, request.url.path, exc.status_code, exc.detail).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(P.error_body("internal router error; see the router log", "server_error"), status_code=500)

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await router.handle(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        return await router.handle(request, CHAT)

    @app.get("/v1/models")
    async def models():
        return await router.proxy_get("/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return await router.proxy_get(f"/v1/models/{model_id}")

    @app.get("/health")
    async def health():
        return await router.health()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE)

    return app
