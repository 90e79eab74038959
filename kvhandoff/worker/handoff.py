"""A prefill or decode worker: the HTTP side of the handoff (docs/HANDOFF.md).

It authenticates `kv_transfer_params` and `/kv/*` with the control token, parses every body into its
message (wire/messages.py: a malformed one is a 400 naming the field), hands each to the protocol
side of its mode among its role's sides (app.py's Handoff: only its role's are built), and turns a
HandoffError into the HTTP error it names; the handoff's metrics.
"""
from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError
from prometheus_client import Counter, Gauge, Histogram

from kvhandoff.engine.block_pool import hash_chain
from kvhandoff.engine.request import RequestOutput, SamplingParams
from kvhandoff.wire import api as P
from kvhandoff.wire import messages as M
from kvhandoff.wire.auth import check_control
from kvhandoff.wire.http import CHAT, StreamingAnswer, read_json_object
from kvhandoff.wire.modes import Role
from kvhandoff.worker.errors import HandoffError
from kvhandoff.worker.kv_events import Publisher
from kvhandoff.worker.metrics import Metrics
from kvhandoff.worker.reuse import lease_retained
from kvhandoff.worker.server import EngineInfo, RequestStream, Server

if TYPE_CHECKING:
    from kvhandoff.worker.app import Handoff


def api_error(exc: HandoffError | M.MessageError, param: str | None = None) -> P.APIError:
    if isinstance(exc, M.MessageError):
        return P.APIError(400, str(exc), param=param)
    return P.APIError(exc.status, str(exc), type="handoff_error" if exc.status >= 500 else None, code=exc.code)


class WorkerHandoff:
    def __init__(self, handoff: Handoff, secret: bytes, metrics: Metrics, info: EngineInfo,
                 publisher: Publisher | None):
        self.handoff, self.role, self.secret, self.info, self.publisher = handoff, handoff.role, secret, info, publisher
        # Lookups routers made on a request's path (a router without this worker's events asks instead).
        self.asked = {"/kv/prompt": 0, "/kv/retained/find": 0}
        r = metrics.registry
        self.handoff_seconds = Histogram("kvhandoff_handoff_seconds", "Handoff duration (this side)",
                                         ["role"], registry=r,
                                         buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.handoff_bytes = Histogram("kvhandoff_handoff_bytes", "KV bytes per handoff", ["role"], registry=r,
                                       buckets=tuple(2 ** k for k in range(10, 34, 2)))
        self.events = Counter("kvhandoff_handoff_events", "Handoff failures, lease expiries, late notifications",
                              ["event"], registry=r)
        self._seen = handoff.counters.snapshot()
        if handoff.retention is not None:
            self.retained_sessions = Gauge("kvhandoff_retained_sessions", "Conversations whose KV is kept",
                                           registry=r)
            self.retained_bytes = Gauge("kvhandoff_retained_bytes", "Bytes of KV kept for later turns", registry=r)
            self.retention_events = Counter("kvhandoff_retention_events", "Retained KV: expiries, evictions, "
                                            "superseded turns, reuse hits (reverse reads granted), lease misses "
                                            "(asked for KV no longer held)", ["event"], registry=r)
            self.leased_bytes = Counter("kvhandoff_retention_leased_bytes", "Bytes of retained KV granted to "
                                        "reverse reads", registry=r)
            self._seen_retention = dict(handoff.retention.counters)

    # ---- request parsing ------------------------------------------------------------------------
    def parse(self, params: dict, request: Request) -> M.KVParams:
        check_control(request, self.secret)
        try:
            kv = M.parse_params(params)
        except M.MessageError as exc:
            raise api_error(exc, "kv_transfer_params") from None
        if kv.role != self.role:
            raise P.APIError(400, f"this worker's role is {self.role}, not {kv.role}", param="kv_transfer_params.role")
        return kv

    # ---- prefill side ---------------------------------------------------------------------------
    async def prefill(self, kv: M.KVParams, prompt_ids: list[int], params: SamplingParams,
                      first_sse: Callable[[RequestOutput], str], started: float,
                      on_close: Callable[[], None]) -> Response:
        """The prefill leg's answer, JSON lines. Its status line goes out as soon as the engine has
        taken the prompt (as a colocated stream's does), so that when the first token is sampled only
        its line crosses the wire (messages.FirstToken: the router streams it to the client at once);
        then the handoff object once the KV is pinned (pull) or written (push), or the error that
        ended the handoff. A refusal before the engine took the prompt is an HTTP error status
        instead. `on_close` runs when the answer is over, however it ends."""
        aio = asyncio.get_running_loop()
        first: asyncio.Future[RequestOutput] = aio.create_future()
        submitted: asyncio.Future[None] = aio.create_future()
        side = self.handoff.prefill.of(kv.mode)
        task = asyncio.ensure_future(side.prefill(
            kv, prompt_ids, params, on_submitted=lambda: submitted.done() or submitted.set_result(None),
            on_first=lambda out: first.done() or first.set_result(out)))
        streaming = False
        try:
            await asyncio.wait({submitted, task}, return_when=asyncio.FIRST_COMPLETED)
            if not submitted.done():
                try:
                    task.result()
                except HandoffError as exc:
                    raise api_error(exc) from None
                raise AssertionError("a prefill answered without computing its prompt")
            sent = functools.partial(side.first_token_sent, kv.handoff_id)
            response = StreamingAnswer(self._answer(first, task, first_sse, started, sent), "application/x-ndjson",
                                       on_close=on_close)
            streaming = True
            return response
        finally:
            if not streaming and not task.done():
                task.cancel()           # the router left: the side frees what it holds

    async def _answer(self, first: asyncio.Future, task: asyncio.Task, first_sse: Callable[[RequestOutput], str],
                      started: float, sent: Callable[[], None]) -> AsyncIterator[bytes]:
        try:
            await asyncio.wait({first, task}, return_when=asyncio.FIRST_COMPLETED)
            if first.done():
                out = first.result()
                t = out.timings or {}
                phases = {"prefill_queue": t.get("queue_ms"), "prefill_compute": t.get("prefill_ms"),
                          "prefill_worker": round((time.perf_counter() - started) * 1e3, 3)}
                token = M.FirstToken(token_id=out.new_token_ids[0], text=out.new_text, sse=first_sse(out),
                                     phases_ms=phases)
                yield b'{"first_token":' + M.encode(token) + b'}\n'
                sent()                  # (resumed once the line was handed to the router's connection)
            try:
                handoff = await task
            except HandoffError as exc:
                yield M.encode({"error": api_error(exc).body()["error"], "status": exc.status}) + b"\n"
                return
            assert first.done(), "a prefill answered without its first token"
            self._observe(Role.PREFILL, handoff)
            yield M.encode({"handoff": handoff}) + b"\n"
        finally:
            if not task.done():
                task.cancel()           # the router hung up mid-answer: the side frees what it holds

    def refused(self, kv: M.KVParams, reason: str) -> None:
        """The prefill leg was refused before it started (backpressure): a registered decode worker
        hears it at once and frees the blocks it reserved."""
        self.handoff.prefill.of(kv.mode).refused(kv.handoff_id, reason)

    # ---- decode side ----------------------------------------------------------------------------
    async def submit_decode(self, kv: M.KVParams, stream: RequestStream, prompt_ids: list[int],
                            params: SamplingParams) -> None:
        try:
            await self.handoff.decode.of(kv.mode).decode(kv, prompt_ids, params, stream.on_output)
        except HandoffError as exc:
            raise api_error(exc) from None
        except ConnectionError as exc:
            raise P.APIError(502, f"prefill worker {getattr(kv, 'prefill_url', '')} unreachable: {exc}",
                             type="handoff_error") from None

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _observe(self, role: Role, handoff: dict) -> None:
        phases = handoff.get("phases_ms") or {}
        total = sum(v for v in phases.values() if isinstance(v, (int, float)))
        if total:
            self.handoff_seconds.labels(role).observe(total / 1000)
        if handoff.get("bytes_transferred"):
            self.handoff_bytes.labels(role).observe(handoff["bytes_transferred"])

    def sync_counters(self) -> None:
        """Fold the handoff's counters into Prometheus (called on scrape)."""
        counters = self.handoff.counters.snapshot()
        for key in ("failures", "lease_expiries", "late_notifications", "verify_failures"):
            if counters[key] > self._seen[key]:
                self.events.labels(key).inc(counters[key] - self._seen[key])
        self._seen = counters
        retention = self.handoff.retention
        if retention is not None:
            stats = retention.stats()
            self.retained_sessions.set(stats["num_retained_sessions"])
            self.retained_bytes.set(stats["retained_bytes"])
            for key in ("expiries", "evictions", "superseded", "reuse_hits", "lease_misses"):
                now = retention.counters[key]
                if now > self._seen_retention[key]:
                    self.retention_events.labels(key).inc(now - self._seen_retention[key])
                    self._seen_retention[key] = now
            now = retention.counters["leased_bytes"]
            if now > self._seen_retention["leased_bytes"]:
                self.leased_bytes.inc(now - self._seen_retention["leased_bytes"])
                self._seen_retention["leased_bytes"] = now

    def health(self) -> dict:
        """What /health adds on this worker: a bidirectional prefill's reuse rates (the router's
        three-way choice among its cache, a fetch and recomputing reads them)."""
        health = {"asked": dict(self.asked)}
        if self.publisher is not None:
            retention = self.handoff.retention
            health["kv_events"] = self.publisher.health(retention.cfg.ttl_s if retention is not None else None,
                                                        self.info.tokenizer.fingerprint)
        reuse = self.handoff.reuse
        return health | ({"reuse_rates": reuse.cost_model.rates()} if reuse is not None else {})

    def info_body(self) -> dict:
        door = self.handoff.door
        return {"worker": self.handoff.worker_name, "role": self.role, "agent_metadata": self.handoff.peers.metadata_b64(),
                "protocol_version": M.PROTOCOL_VERSION, "block_size": door.block_size,
                "block_bytes": door.layout.block_bytes, "num_layers": door.layout.num_layers,
                "layer_bytes": door.layout.layer_bytes, "dtype": str(door.engine.dtype).removeprefix("torch."),
                "model": door.engine.served_name}


async def control_body(request: Request, secret: bytes) -> dict:
    """An authenticated /kv/* message: a JSON object, or a 400 (never a 500)."""
    check_control(request, secret)
    return await read_json_object(request)


async def control_message(request: Request, secret: bytes, cls: type, what: str):
    """An authenticated /kv/* message as its Struct, or a 400 naming the field."""
    body = await control_body(request, secret)
    try:
        return M.parse(cls, body, what)
    except M.MessageError as exc:
        raise api_error(exc) from None


def attach_worker_routes(app: FastAPI, handoff: WorkerHandoff, server: Server) -> None:
    secret, parts = handoff.secret, handoff.handoff
    door, prefill, decode, retention = parts.door, parts.prefill, parts.decode, parts.retention

    @app.get("/kv/info")
    async def kv_info(request: Request):
        check_control(request, secret)
        return handoff.info_body()

    @app.get("/kv/tokenizer")
    async def kv_tokenizer(request: Request):
        """The files this worker's tokenizer was made from: a router tokenizes prompts as the workers do,
        to look them up in its index of what each worker holds (router/kv_index.py). Once per router
        and tokenizer (`kv_events.tokenizer` in /health is their fingerprint)."""
        check_control(request, secret)
        return {"fingerprint": server.info.tokenizer.fingerprint, "files": server.info.tokenizer.files}

    @app.get("/kv/held")
    async def kv_held(request: Request):
        """What this worker holds now, as its KV events have told the routers: its prefix cache's block
        hashes and its retained turns (a router's index is checked against it: tests, operators)."""
        check_control(request, secret)

        def look() -> dict:
            return {"blocks": door.cached_blocks(),
                    "retained": sorted(retention.sessions) if retention is not None else []}
        return await asyncio.wrap_future(door.call(look))

    @app.post("/kv/rebind")
    async def kv_rebind(request: Request):
        """Late-bound push, router -> prefill: the handoff goes to another decode worker (409 once its
        WRITE has started)."""
        message = await control_message(request, secret, M.Rebind, "/kv/rebind")
        if prefill is None:
            raise P.APIError(400, "rebinds go to prefill workers")
        try:
            prefill.push.rebind(message)
        except HandoffError as exc:
            raise api_error(exc) from None
        return {"rebound": message.handoff_id, "binding": message.binding}

    @app.post("/kv/release")
    async def kv_release(request: Request):
        """Pull, decode -> prefill (or the router): the pinned KV will not be read."""
        message = await control_message(request, secret, M.HandoffRef, "/kv/release")
        return {"released": prefill is not None and prefill.pull.release(message.handoff_id)}

    @app.post("/kv/failed")
    async def kv_failed(request: Request):
        """Decode side: the router saw this handoff's prefill fail (push). Usually the prefill worker
        says so itself over the notification channel; this path covers a prefill that died or whose
        channel is what broke, so decode acts now instead of after --kv-timeout-s."""
        report = await control_message(request, secret, M.KVFailed, "/kv/failed")
        if decode is None:
            raise P.APIError(400, "failure reports go to decode workers")
        return {"failed": parts.kv_failed(report)}

    @app.post("/kv/cancel")
    async def kv_cancel(request: Request):
        """The router gave up on a handoff (its client left): free what this worker holds for it."""
        message = await control_message(request, secret, M.HandoffRef, "/kv/cancel")
        parts.cancel(message.handoff_id)
        return {"cancelled": message.handoff_id}

    @app.post("/kv/retained/lease")
    async def kv_retained_lease(request: Request):
        """Bidirectional, decode side: a prefill worker wants to READ a retained conversation's first
        `num_blocks` blocks. Holds them in place until it reports back (or the read lease lapses)."""
        message = await control_message(request, secret, M.LeaseRequest, "/kv/retained/lease")
        if message.num_blocks <= 0:
            raise P.APIError(400, "num_blocks must be a positive integer", param="num_blocks")
        lease = await parts.chores.blocking(lease_retained, door, parts.peers, retention, message,
                                            parts.cfg.kv_timeout_s)
        if lease is None:
            raise P.APIError(410, f"no retained KV {message.retention_id!r} with {message.num_blocks} blocks here "
                             "(expired, evicted or never kept)", type="handoff_error", code="retained_kv_gone")
        return lease

    @app.post("/kv/retained/release")
    async def kv_retained_release(request: Request):
        """Bidirectional, decode side: the router says this retained conversation will not be read."""
        message = await control_message(request, secret, M.RetainedRef, "/kv/retained/release")
        released = retention is not None and await parts.chores.blocking(
            lambda: door.call(lambda: retention.release(message.retention_id)).result(30))
        return {"released": bool(released)}

    @app.post("/kv/retained/find")
    async def kv_retained_find(request: Request):
        """Bidirectional, decode side: does this worker keep the history a router is looking for
        (by session id or block hashes)? Any router asks, whichever served the previous turn."""
        message = await control_message(request, secret, M.RetainedQuery, "/kv/retained/find")
        handoff.asked["/kv/retained/find"] += 1
        return {"retained": None if retention is None else retention.find(message)}

    @app.post("/kv/prompt")
    async def kv_prompt(request: Request):
        """The block hashes a request's prompt has here: the router finds a conversation's retained KV
        by them (bidirectional, a client that names no session) and estimates prefix-cache hits."""
        query = await control_message(request, secret, M.PromptQuery, "/kv/prompt")
        handoff.asked["/kv/prompt"] += 1
        chat = query.endpoint == CHAT
        try:
            parsed = (P.ChatCompletionRequest if chat else P.CompletionRequest).model_validate(query.request)
        except ValidationError as exc:
            raise P.APIError(400, f"not a valid request: {exc.errors()[0].get('msg')}") from None
        ids = server.chat_prompt(parsed) if chat else server.completion_prompt(parsed)
        hashes = hash_chain(ids, door.block_size)
        # What this worker's prefix cache holds of it now, for cache-aware routing by any router.
        return {"num_tokens": len(ids), "block_size": door.block_size, "block_hashes": [h.hex() for h in hashes],
                "cached_blocks": door.cached_prefix_len(hashes)}
