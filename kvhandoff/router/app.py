"""The router: an OpenAI-compatible front that sequences a prefill worker and a decode worker per request.

It never touches KV (docs/HANDOFF.md). For every request it chooses one `handoff_id` (used on every
side), runs the mode's router leg (legs.py: which workers, in what order), streams the prefill's first
token and then the decode worker's answer as they arrive (relay.py), and merges what both workers
report into one `handoff` object (native.py; vllm.py for vLLM workers). A worker that fails before
the client saw a token is replaced once (retry.py), one that fails after it is migrated from
(relay.py); nothing outlives --request-timeout.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvhandoff.router import admin, legs
from kvhandoff.router.answer import UpstreamError
from kvhandoff.router.attempt import Attempt, Phase, rewrite_final
from kvhandoff.router.errors import Relay, deadline_error, describe
from kvhandoff.router.kv_feed import Feeds
from kvhandoff.router.kv_index import KVIndex
from kvhandoff.router.native import NativeAttempt
from kvhandoff.router.policies import DecodePolicy, PrefillPolicy, uncached_tokens
from kvhandoff.router.pool import Worker, WorkerPool
from kvhandoff.router.prefix import PromptFacts, prompt_facts
from kvhandoff.router.prompts import Prompts
from kvhandoff.router.relay import relay_events
from kvhandoff.router.retry import retry_elsewhere
from kvhandoff.router.sessions import Sessions
from kvhandoff.router.upstream import Upstream
from kvhandoff.router.vllm import VllmAttempt, VllmState
from kvhandoff.router.vllm_sessions import VllmSessions
from kvhandoff.wire import api as P
from kvhandoff.wire import messages as M
from kvhandoff.wire.auth import control_headers, control_token
from kvhandoff.wire.http import (CHAT, COMPLETIONS, CONTENT_TYPE, LATENCY_BUCKETS, SSEResponse, read_json_object,
                                  wait_disconnect)
from kvhandoff.wire.modes import Engine, Mode, Role
from kvhandoff.wire.vllm import refusal

log = logging.getLogger("kvhandoff.router")
SESSION_HEADER = "x-session-id"


@dataclass
class RouterConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    mode: Mode
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
    # More than one router: where a conversation's history is kept is asked of the decode workers at
    # each turn (all at once, /kv/retained/find), since another router may have served the last turn;
    # one router alone trusts its own map (no round trip).
    shared_sessions: bool = False
    decode_policy: DecodePolicy = DecodePolicy.FEWEST     # policies.py
    prefill_policy: PrefillPolicy = PrefillPolicy.FEWEST
    # Selective disaggregation: a prompt with fewer uncached tokens than this is computed colocated on a
    # decode worker, with no handoff (0 = every request is disaggregated).
    disagg_min_tokens: int = 0
    # Late-bound push: the decode worker picked at arrival may be replaced while the prompt is still
    # being computed, if it has fallen behind (policies.late_binding_target; legs.late_bind).
    late_binding: bool = False
    # A stream whose decode worker fails after the client has tokens continues on another decode worker
    # from the tokens sent (relay.py), at most this many times; 0: it ends with an error event.
    migration_limit: int = 1
    # A worker that joined by itself (`serve --join`) and has not answered a health poll for this long
    # died without leaving: it is drained from the pool (it joins again if it comes back).
    forget_joined_after_s: float = 30.0
    # Legs to a worker that offers a persistent channel (its /health's channel_port; wire/channel.py) go
    # over it; off: every leg is an HTTP request.
    worker_channels: bool = True
    # What the workers are (router/vllm.py for vLLM's), and how long vLLM decode workers keep a turn's KV
    # (their decoder_kv_blocks_ttl; bidirectional).
    engine: Engine = Engine.KVHANDOFF
    retention_ttl: float = 480.0

    def __post_init__(self):
        self.mode = Mode.parse(self.mode) if not isinstance(self.mode, Mode) else self.mode
        self.engine = Engine(self.engine)
        self.decode_policy, self.prefill_policy = DecodePolicy(self.decode_policy), PrefillPolicy(self.prefill_policy)
        assert self.prefill_urls and self.decode_urls, "the router needs a prefill and a decode worker"
        assert self.secret, "the router needs the deployment secret to talk to its workers"
        if self.disagg_min_tokens < 0:
            raise ValueError("--disagg-min-tokens must be >= 0")
        if self.forget_joined_after_s <= 0:
            raise ValueError("--forget-joined-after-s must be > 0")
        if self.migration_limit < 0:
            raise ValueError("--migration-limit must be >= 0 (0: no migration)")
        if self.late_binding and self.mode.is_pull:
            raise ValueError(f"--late-binding is for the push modes; {self.mode} picks the decode worker "
                             "after the prefill already")
        if self.engine is Engine.VLLM:
            self.check_vllm()

    def check_vllm(self) -> None:
        """What a vLLM 0.32 fleet can do under this router (wire/vllm.py); the rest is refused."""
        why = refusal(self.mode.value, self.bidirectional, self.late_binding, self.prefill_policy is PrefillPolicy.CACHE,
                      self.disagg_min_tokens, self.shared_sessions)
        if why is not None:
            raise ValueError(f"--engine vllm: {why}")


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
        self.migrations = Counter("kvhandoff_router_migrations", "Streams continued on another decode worker "
                                  "after theirs failed with the client holding tokens", ["mode"], registry=r)
        self.rebinds = Counter("kvhandoff_router_rebinds", "Late binding: requests moved to another decode "
                               "worker while their prompt was computed, or refused the move (WRITE started)",
                               ["mode", "outcome"], registry=r)
        self.vllm_reuse = Counter("kvhandoff_router_vllm_reuse", "--engine vllm --bidirectional: turns kept by a "
                                  "decode worker, and later turns whose history was fetched or recomputed "
                                  "(edited, expired, on a dead worker)", ["outcome"], registry=r)
        self.legs = Counter("kvhandoff_router_legs", "Requests sent to workers (legs, health polls, control "
                            "messages), by how: over a worker's persistent channel, or as HTTP", ["transport"], registry=r)
        self.in_flight = Gauge("kvhandoff_router_worker_in_flight", "Requests in flight per worker",
                               ["role", "worker"], registry=r)
        self.asked = Counter("kvhandoff_router_asked", "Lookups asked of a worker on a request's path (/kv/prompt, "
                             "/kv/retained/find): workers whose KV events are not fresh", ["path"], registry=r)
        self.index_tokens = Counter("kvhandoff_router_kv_index_tokens", "Prompt tokens the KV-event index said the "
                                    "chosen prefill worker caches (predicted) and what it had (actual)", ["kind"],
                                    registry=r)
        self.index_misses = Counter("kvhandoff_router_kv_index_misses", "Prefills whose worker had fewer cached "
                                    "tokens than the index said (a stale index: recomputed)", registry=r)
        self.feeds_fresh = Gauge("kvhandoff_router_kv_events_fresh", "Workers whose KV events are synchronised and "
                                 "current (1) or stale: asked instead (0)", ["worker"], registry=r)
        self.feed_gaps = Gauge("kvhandoff_router_kv_event_gaps", "KV-event batches found missing by their sequence "
                               "number (each repaired by a replay)", ["worker"], registry=r)
        self.index_blocks = Gauge("kvhandoff_router_kv_index_blocks", "Distinct blocks in the KV-event index", registry=r)
        # Labelled children, looked up once: .labels() (validation, a lock) on ~20 samples a request
        # was a measurable share of the router's CPU.
        self.children: dict[tuple, object] = {}

    def feeds(self, feeds: Feeds, index: KVIndex) -> None:
        """The KV-event gauges, at scrape time."""
        now = time.monotonic()
        for url, feed in feeds.feeds.items():
            self.child(self.feeds_fresh, url).set(1 if feed.fresh(now) else 0)
            self.child(self.feed_gaps, url).set(feed.counters["gaps"])
        self.index_blocks.set(len(index.holders))

    def child(self, metric, *labels: str):
        key = (metric, *labels)
        if (found := self.children.get(key)) is None:
            found = self.children[key] = metric.labels(*labels)
        return found

    def handoff(self, mode: str, merged: M.ClientHandoff) -> None:
        for phase, ms in merged.phases_ms.items():
            if ms is not None:
                self.child(self.phase, mode, phase).observe(ms / 1e3)
        if merged.router_ms is not None:
            self.child(self.phase, mode, "router").observe(merged.router_ms / 1e3)
        if merged.bytes_transferred is not None:
            self.child(self.bytes, mode).inc(merged.bytes_transferred)


class Router:
    def __init__(self, config: RouterConfig):
        self.config, self.mode = config, config.mode
        self.metrics = RouterMetrics()
        self.pool = WorkerPool(config.prefill_urls, config.decode_urls,
                               on_change=self.count_in_flight,
                               decode_policy=config.decode_policy, prefill_policy=config.prefill_policy,
                               forget_joined_after_s=config.forget_joined_after_s, on_polled=self.polled)
        self.leg = legs.pull if self.mode.is_pull else legs.push
        self.auth = control_headers(config.secret)
        self.upstream: Upstream | None = None           # legs to the workers (upstream.py)
        self.background: set[asyncio.Task] = set()   # health polls, control messages, stream cleanups
        self.num_in_flight = 0                        # client requests not finished yet
        if config.engine is Engine.VLLM:
            self.attempt_class, self.vllm = VllmAttempt, VllmState()
            self.sessions = VllmSessions(self, config.retention_ttl)
        else:
            self.attempt_class, self.sessions = NativeAttempt, Sessions(self)
        # What each worker holds, from its KV events (kv_feed.py, kv_index.py; ours only: vLLM's
        # routers ask vLLM's /tokenize), and the router's own tokenizer to look prompts up in it.
        self.index = KVIndex(self.sessions if isinstance(self.sessions, Sessions) else None)
        self.feeds = Feeds(self.index, config.secret)
        self.prompts = Prompts()

    async def start(self) -> None:
        # No read timeout: a long prefill or a long generation is not a failure; the request deadline
        # (config.request_timeout) bounds everything instead.
        self.upstream = Upstream(self.config.connect_timeout, self.auth, control_token(self.config.secret),
                                 channels=self.config.worker_channels, sent=self.metrics.legs)
        if self.config.health_interval > 0:
            self.spawn(self.pool.poll(self.upstream, self.config.health_interval))

    async def stop(self) -> None:
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        self.feeds.close()
        await self.upstream.close()

    def polled(self, worker: Worker, reachable: bool) -> None:
        """After a worker's /health poll: follow its KV events (again, if it restarted), fetch its
        tokenizer once, use the channel it offers; a worker that left or cannot be reached is forgotten
        (its channel only once it left: a slow poll must not break its legs)."""
        if self.upstream is None:
            return
        if reachable:
            self.upstream.offer(worker.url, worker.last_health.get("channel_port"))
        elif self.pool.find(worker.url) is not worker:
            self.upstream.drop(worker.url)
        if self.config.engine is Engine.VLLM:
            return
        if not reachable:
            self.feeds.stop(worker.url)
            return
        self.feeds.update(worker.url, worker.last_health)
        about = worker.last_health.get("kv_events")
        if isinstance(about, dict) and worker.role == Role.PREFILL:
            fetch = self.prompts.want(self.upstream, worker.url, str(about.get("tokenizer") or ""))
            if fetch is not None:
                self.background.add(fetch)
                fetch.add_done_callback(self.background.discard)

    def local_facts(self, attempt: Attempt) -> PromptFacts | None:
        """The prompt's facts made here (prompts.py), as the prefill workers whose events are fresh see it."""
        fresh = self.feeds.fresh_urls()
        for worker in self.pool.serving(Role.PREFILL):
            feed = self.feeds.feeds.get(worker.url) if worker.url in fresh else None
            if feed is not None:
                return self.prompts.facts(feed.info.tokenizer, feed.info.block_size, attempt.endpoint, attempt.body)
        return None

    def spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def tell(self, worker: Worker, path: str, body: M.Message) -> None:
        """Fire-and-forget control message (/kv/cancel, /kv/release, /kv/failed, /kv/retained/release)."""
        async def send():
            try:
                await self.upstream.call("POST", worker.url + path, body, timeout=5.0)
            except UpstreamError as e:      # a worker known to be down: expected, not worth a warning each
                log.log(logging.WARNING if worker.healthy else logging.INFO, "handoff %s: %s on %s failed: %s",
                        getattr(body, "handoff_id", None) or getattr(body, "retention_id", None), path, worker.url, describe(e))
        self.spawn(send())

    def count_in_flight(self, worker: Worker) -> None:
        self.metrics.child(self.metrics.in_flight, worker.role, worker.url).set(worker.in_flight)

    def merged(self, attempt: Attempt, merged: M.ClientHandoff, retained: M.Retained | None) -> None:
        """An attempt's handoff object is complete: count its phases, remember where its KV stays."""
        if self.config.bidirectional:
            merged.retained = self.sessions.remember(attempt, retained)
        self.metrics.handoff(self.mode.value, merged)

    # -- one request ----------------------------------------------------------------------------------
    async def handle(self, request: Request, endpoint: str) -> Response:
        loop = asyncio.get_running_loop()
        arrival = request.scope.get("arrival") or time.perf_counter()
        attempt = self.attempt_class(self, endpoint, False, arrival, loop.time() + self.config.request_timeout)
        self.num_in_flight += 1                       # finish() takes it back, once per request
        try:
            attempt.body = await read_client_body(request)
            attempt.stream = bool(attempt.body.get("stream"))
            if self.config.bidirectional:
                attempt.session_id = session_of(request, attempt.body)
        except P.APIError as e:
            attempt.status = str(e.status)
            await self.finish(attempt)
            return JSONResponse(e.body(), status_code=e.status)
        work = asyncio.ensure_future(self.dispatch(attempt))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, timeout=self.config.request_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.wait({work})
        response = self.outcome(attempt, work, client_gone=gone.done() and not gone.cancelled())
        if not isinstance(response, SSEResponse):     # a stream finishes when its body ends
            await self.finish(attempt)
        return response

    async def dispatch(self, attempt: Attempt) -> Response:
        """The client's response: a stream relayed from the decode worker, or its whole JSON answer."""
        if self.config.bidirectional:
            attempt.candidate = await self.sessions.find(attempt)
        if self.config.prefill_policy is PrefillPolicy.CACHE or self.config.disagg_min_tokens:
            await self.prompt_facts(attempt)
        leg = self.colocated_leg if self.short(attempt) else self.leg
        while True:
            try:
                await leg(attempt)
                if attempt.stream:
                    # finish() awaits (closing upstream), and SSEResponse calls on_close synchronously once
                    # the response is over, outside the cancel scope Starlette ends a stream with: a task.
                    return SSEResponse(relay_events(attempt, leg), on_close=lambda: self.spawn(self.finish(attempt)))
                data = await attempt.read_json(attempt.decode, await attempt.decode_task)
                break
            except (Relay, P.APIError) as failure:
                failure = attempt.blame(failure)
                if not await retry_elsewhere(attempt, failure):
                    raise failure
        attempt.phase = Phase.DRAINED
        attempt.open_legs.discard(Role.DECODE)
        if attempt.retried:
            rewrite_final(attempt, data, attempt.retried_handoff())
        elif isinstance(data.get("handoff"), dict):
            rewrite_final(attempt, data, await attempt.merge(data["handoff"]))
        return JSONResponse(data)

    async def prompt_facts(self, attempt: Attempt) -> PromptFacts | None:
        """The prompt's tokens and block hashes, fetched once per request (the policies and the session
        lookup share them), with what every prefill worker caches of it when a policy weighs that."""
        if attempt.facts is None:
            every = self.config.prefill_policy is PrefillPolicy.CACHE or bool(self.config.disagg_min_tokens)
            attempt.facts = await prompt_facts(self, attempt, every_worker=every)
        return attempt.facts

    def short(self, attempt: Attempt) -> bool:
        """Selective disaggregation: too few tokens to compute for a handoff to pay. Not for a turn
        whose history a decode worker retains (its prefill would read it back: bidirectional reuse)."""
        facts, threshold = attempt.facts, self.config.disagg_min_tokens
        if not threshold or facts is None or attempt.candidate is not None:
            return False
        uncached = min(uncached_tokens(w, facts, self.pool.prefix) for w in self.pool.serving(Role.PREFILL))
        return uncached < threshold

    async def colocated_leg(self, attempt: Attempt) -> None:
        facts = attempt.facts
        attempt.decode_task = asyncio.ensure_future(attempt.run_colocated(
            f"short prompt ({facts.num_tokens} tokens, fewer than --disagg-min-tokens "
            f"{self.config.disagg_min_tokens} uncached)", "colocated"))
        await attempt.decode_task

    def outcome(self, attempt: Attempt, work: asyncio.Task, client_gone: bool) -> Response:
        if work.cancelled():
            if client_gone:
                attempt.status = "499"
                return Response(status_code=499)   # nobody is listening; nginx's "client closed request"
            err = deadline_error(self.config.request_timeout)
        else:
            err = work.exception()
            if err is None:
                return work.result()
        if isinstance(err, Relay):
            attempt.status = str(err.status)
            headers = {"Retry-After": err.retry_after} if err.retry_after else None   # a worker's backpressure
            return JSONResponse(err.body, status_code=err.status, headers=headers)
        if not isinstance(err, P.APIError):
            log.error("handoff %s failed in the router", attempt.handoff_id, exc_info=err)
            err = P.APIError(500, "internal router error; see the router log")
        elif err.status >= 500:
            log.warning("handoff %s: %s (%s)", attempt.handoff_id, err.message, attempt.workers_named())
        attempt.status = str(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    async def finish(self, attempt: Attempt) -> None:
        """Close whatever is still open for this request and count it; idempotent."""
        if attempt.ended:
            return
        drained = attempt.phase is Phase.DRAINED
        attempt.phase = Phase.ENDED
        self.num_in_flight -= 1
        await attempt.release_legs(drained)
        status = attempt.status
        if attempt.stream and status == "200" and not drained:
            status = "499"                     # the client left mid-stream
        self.metrics.child(self.metrics.requests, self.mode.value, attempt.endpoint, status).inc()
        if status == "200":
            self.metrics.child(self.metrics.e2e, self.mode.value).observe(attempt.ms() / 1e3)

    # -- health and models ----------------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        reports = await self.pool.check_all(self.upstream)
        missing = self.pool.missing_roles()
        body = {"status": "error" if missing else "ok", "role": "router", "mode": self.mode.value,
                "decode_policy": self.config.decode_policy.value, "prefill_policy": self.config.prefill_policy.value,
                "disagg_min_tokens": self.config.disagg_min_tokens, "late_binding": self.config.late_binding,
                "health_interval": self.config.health_interval,
                "num_in_flight": self.num_in_flight, "workers": reports,
                "kv_index": {"blocks": len(self.index.holders), "tokenizers": sorted(self.prompts.tokenizers),
                             "retained_turns": len(self.index.sessions.map) if self.index.sessions else 0,
                             "feeds": self.feeds.status()}}
        if missing:
            body["error"] = f"no healthy {' or '.join(missing)} worker"
        return JSONResponse(body, status_code=503 if missing else 200)

    async def proxy_get(self, path: str) -> Response:
        """GET from the first worker that answers (decode workers first: they serve the answers)."""
        errors = []
        for worker in self.pool.decodes + self.pool.prefills:
            try:
                resp = await self.upstream.open("GET", worker.url + path, timeout=10.0)
                try:
                    content = await resp.read()
                finally:
                    resp.close()
            except UpstreamError as e:
                errors.append(f"{worker.url}: {describe(e)}")
                continue
            return Response(content, status_code=resp.status, media_type=resp.content_type or "application/json")
        err = P.APIError(502, f"no worker answered {path} ({'; '.join(errors)})", type="server_error",
                         code="worker_unreachable")
        return JSONResponse(err.body(), status_code=502)


async def read_client_body(request: Request) -> dict:
    """The router's only validation: a JSON object without the router-owned field. Workers check the rest."""
    data = await read_json_object(request)
    if "kv_transfer_params" in data:
        raise P.APIError(400, "kv_transfer_params is reserved: the router sets it for its workers; remove it "
                         "from the request", param="kv_transfer_params")
    return data


def session_of(request: Request, body: dict) -> str | None:
    session_id = request.headers.get(SESSION_HEADER) or body.pop("session_id", None)
    if session_id is not None and not (isinstance(session_id, str) and 0 < len(session_id) <= 256):
        raise P.APIError(400, "session_id must be a non-empty string of at most 256 characters", param="session_id")
    return session_id


# ---------------------------------------------------------------------------------------------------
# App

class ArrivalTime:
    """Stamps every HTTP request as the server hands it to the app (perf_counter, scope["arrival"]):
    a request's time at the router counts from there, routing and body parsing included."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope["arrival"] = time.perf_counter()
        await self.app(scope, receive, send)


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
    app.add_middleware(ArrivalTime)
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

    admin.install(app, router)

    @app.get("/metrics")
    async def metrics():
        router.metrics.feeds(router.feeds, router.index)
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE)

    return app
