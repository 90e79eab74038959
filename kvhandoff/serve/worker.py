"""A prefill or decode worker: the HTTP side of the handoff (docs/HANDOFF.md).

It authenticates `kv_transfer_params` and `/kv/*` with the control token, does the blocking parts of a
handoff (peer handshakes, the push registration POST) in asyncio or its executor, and hands the rest
to the Connector, which owns the engine-side and transfer-side work.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from prometheus_client import Counter, Gauge, Histogram

from kvhandoff.engine.block_pool import hash_chain
from kvhandoff.engine.request import SamplingParams
from kvhandoff.handoff.connector import MODES, PULL_MODES, Connector, HandoffError
from kvhandoff.handoff.reuse import decide
from kvhandoff.serve import protocol as P
from kvhandoff.serve.auth import check_control, control_headers
from kvhandoff.serve.server import CHAT, RequestStream, Server

ROLES = ("prefill", "decode")


@dataclass
class KVRequest:
    handoff_id: str
    mode: str
    role: str
    remote: dict | None = None          # pull, decode side: the prefill's handoff object
    prefill_url: str | None = None      # push, decode side
    decode_url: str | None = None       # push, prefill side (informational)
    reuse: dict | None = None           # bidirectional, prefill side: where the conversation's KV is kept
    retain: bool = False                # bidirectional, decode side: keep this turn's KV
    supersedes: str | None = None       # ... replacing this retained turn

    @property
    def remote_prompt_ids(self) -> list[int] | None:
        return None if self.remote is None else list(self.remote["prompt_token_ids"])


def check_remote(remote) -> None:
    """A pull decode's handoff object must be whole and well-typed before anything acts on it: it
    comes from the router, which got it from a prefill worker, but a control endpoint trusts no body."""
    if not isinstance(remote, dict):
        raise P.APIError(400, "a pull decode needs kv_transfer_params.remote", param="kv_transfer_params.remote")
    def int_list(value) -> bool:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    checks = {"prompt_token_ids": int_list, "block_ids": int_list, "checksums": int_list,
              "num_kv_tokens": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "agent_metadata": lambda v: isinstance(v, str)}
    bad = [name for name, ok in checks.items() if not ok(remote.get(name))]
    if bad:
        raise P.APIError(400, f"kv_transfer_params.remote lacks or mistypes {', '.join(bad)}",
                         param="kv_transfer_params.remote")


class WorkerHandoff:
    def __init__(self, server: Server, connector: Connector, role: str, secret: bytes):
        assert role in ROLES
        self.server, self.connector, self.role, self.secret = server, connector, role, secret
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0), headers=control_headers(secret))
        self.peer_info: dict[str, str] = {}         # prefill URL -> its agent's peer name
        # Handshakes and checksums run here, not in asyncio's default executor, so nothing else
        # queued there can delay a registration.
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="kvh-http")
        r = server.metrics.registry
        self.handoff_seconds = Histogram("kvhandoff_handoff_seconds", "Handoff duration (this side)",
                                         ["role"], registry=r,
                                         buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.handoff_bytes = Histogram("kvhandoff_handoff_bytes", "KV bytes per handoff", ["role"], registry=r,
                                       buckets=tuple(2 ** k for k in range(10, 34, 2)))
        self.events = Counter("kvhandoff_handoff_events", "Handoff failures, lease expiries, late notifications",
                              ["event"], registry=r)
        self._seen = dict(connector.counters)
        if connector.retention is not None:
            self.retained_sessions = Gauge("kvhandoff_retained_sessions", "Conversations whose KV is kept",
                                           registry=r)
            self.retained_bytes = Gauge("kvhandoff_retained_bytes", "Bytes of KV kept for later turns", registry=r)
            self.retention_events = Counter("kvhandoff_retention_events", "Retained KV: expiries, evictions, "
                                            "superseded turns, reuse hits (reverse reads)", ["event"], registry=r)
            self._seen_retention = dict(connector.retention.counters)

    # ---- request parsing ------------------------------------------------------------------------
    def parse(self, params: dict, request: Request) -> KVRequest:
        check_control(request, self.secret)
        try:
            kv = KVRequest(handoff_id=str(params["handoff_id"]), mode=params["mode"], role=params["role"],
                           remote=params.get("remote"), prefill_url=params.get("prefill_url"),
                           decode_url=params.get("decode_url"), reuse=params.get("reuse"),
                           retain=params.get("retain") is True, supersedes=params.get("supersedes"))
        except (KeyError, TypeError) as exc:
            raise P.APIError(400, f"kv_transfer_params lacks {exc}", param="kv_transfer_params") from None
        if kv.mode not in MODES:
            raise P.APIError(400, f"unknown handoff mode {kv.mode!r}; one of {', '.join(MODES)}",
                             param="kv_transfer_params.mode")
        if kv.role != self.role:
            raise P.APIError(400, f"this worker's role is {self.role}, not {kv.role}", param="kv_transfer_params.role")
        if kv.role == "decode" and kv.mode in PULL_MODES:
            check_remote(kv.remote)
        if kv.role == "decode" and kv.mode not in PULL_MODES and not kv.prefill_url:
            raise P.APIError(400, "a push decode needs kv_transfer_params.prefill_url", param="kv_transfer_params")
        if kv.reuse is not None and not (isinstance(kv.reuse, dict) and isinstance(kv.reuse.get("decode_url"), str)
                                         and isinstance(kv.reuse.get("retention_id"), str)
                                         and isinstance(kv.reuse.get("block_hashes"), list)):
            raise P.APIError(400, "kv_transfer_params.reuse needs decode_url, retention_id and block_hashes",
                             param="kv_transfer_params.reuse")
        if kv.supersedes is not None and not isinstance(kv.supersedes, str):
            raise P.APIError(400, "kv_transfer_params.supersedes must be a string", param="kv_transfer_params")
        return kv

    # ---- prefill side ---------------------------------------------------------------------------
    async def prefill(self, kv: KVRequest, request: Request, prompt_ids: list[int], params: SamplingParams):
        aio = asyncio.get_running_loop()
        done: asyncio.Future = aio.create_future()
        preloaded, reuse = await self.reuse(kv, prompt_ids)

        def on_output(out) -> None:        # engine thread
            if out.finished:
                aio.call_soon_threadsafe(lambda: done.done() or done.set_result(out))
        try:
            job = self.connector.submit_prefill(kv.handoff_id, prompt_ids, params, kv.mode, on_output,
                                                preloaded=preloaded)
        except (ValueError, HandoffError) as exc:
            if preloaded is not None:
                self.connector.loop.call(lambda: self.connector.engine.release_pinned(preloaded[0]))
            self.connector.prefill_refused(kv.handoff_id, str(exc))
            raise P.APIError(getattr(exc, "status", 400), str(exc)) from None
        try:
            out = await done
        except asyncio.CancelledError:     # the router went away: free what we hold
            self.connector.cancel(kv.handoff_id)
            raise
        if out.finish_reason != "prefilled":
            raise P.APIError(500 if out.finish_reason == "error" else 503,
                             f"prefill did not complete: {out.error or out.finish_reason}")
        if kv.mode in PULL_MODES:
            handoff = await aio.run_in_executor(self.pool, self.connector.pull_params, kv.handoff_id, out, prompt_ids)
        else:
            handoff = {"handoff_id": kv.handoff_id, "prefill_worker": self.connector.worker_name,
                       "num_kv_tokens": out.num_kv_tokens, "blocks": len(out.kv_block_ids or [])}
            if job is not None:     # wait for the WRITE (or its failure) so the phases are complete
                await self._wait_job(job)
                if job.failed:
                    raise P.APIError(502, job.failed, type="handoff_error")
                handoff["bytes_transferred"] = job.bytes_sent
            handoff["phases_ms"] = {"prefill_queue": out.timings["queue_ms"],
                                    "prefill_compute": out.timings["prefill_ms"],
                                    **(job.phases if job is not None else {})}
        handoff.update(reuse)
        self._observe("prefill", out.timings.get("total_ms"), handoff.get("bytes_transferred"))
        return JSONResponse({"handoff": handoff})

    async def reuse(self, kv: KVRequest, prompt_ids: list[int]) -> tuple[tuple[str, int] | None, dict]:
        """Bidirectional: fetch the conversation's retained KV from the decode worker that kept it, if
        it is a true prefix of this prompt and fetching beats recomputing. Returns (preloaded for the
        engine or None, the report fields for the handoff object). A failed fetch only means recompute."""
        report = {"reused_tokens": 0, "reverse_bytes": 0}
        if kv.reuse is None or not self.connector.cfg.bidirectional:
            why = "no retained history named" if kv.reuse is None else "this worker runs without --bidirectional"
            report["reuse_decision"] = {"decision": "none", "reason": why}
            return None, report
        c, engine = self.connector, self.connector.engine
        hashes = hash_chain(prompt_ids, engine.block_size)
        decision, blocks = decide(c.cfg.reuse, c.cost_model, len(prompt_ids), hashes, kv.reuse, engine.block_size,
                                  c.layout.block_bytes, engine.pool.cached_prefix_len(hashes))
        preloaded = None
        if blocks:
            started = time.monotonic()
            try:
                lease = await self._lease(kv.reuse["decode_url"], kv.reuse["retention_id"], blocks)
                aio = asyncio.get_running_loop()
                peer = await aio.run_in_executor(self.pool, c.ensure_peer, lease["agent_metadata"])
                read_started = time.monotonic()
                fetch = aio.run_in_executor(self.pool, c.fetch_retained, kv.handoff_id, peer, lease, blocks)
                try:
                    pin_id, nbytes = await asyncio.shield(fetch)
                except asyncio.CancelledError:      # the router gave up: the blocks must not stay pinned
                    fetch.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or c.loop.call(
                        lambda: engine.release_pinned(f.result()[0])))
                    raise
            except HandoffError as exc:
                decision.decision, decision.reason = "recomputed", f"fetch failed, recomputed: {exc}"
            else:
                done = time.monotonic()
                c.cost_model.observe_fetch(nbytes, done - read_started, done - started)
                preloaded = (pin_id, blocks * engine.block_size)
                report.update(reused_tokens=blocks * engine.block_size, reverse_bytes=nbytes)
                decision.fetch_ms = round((done - started) * 1e3, 3)
        report["reuse_decision"] = decision.report()
        return preloaded, report

    async def _lease(self, decode_url: str, retention_id: str, num_blocks: int) -> dict:
        try:
            r = await self.http.post(f"{decode_url}/kv/retained/lease",
                                     json={"retention_id": retention_id, "num_blocks": num_blocks})
        except httpx.HTTPError as exc:
            raise HandoffError(f"decode worker {decode_url} unreachable: {exc}", 502) from None
        if r.status_code != 200:
            raise HandoffError(f"decode worker {decode_url} has no such retained KV any more ({r.status_code})", 410)
        lease = r.json()
        if not isinstance(lease, dict) or not {"lease_id", "block_ids", "checksums", "agent_metadata"} <= set(lease):
            raise HandoffError(f"decode worker {decode_url} answered a malformed read lease", 502)
        return lease

    async def _wait_job(self, job) -> None:
        """Wait without holding an executor thread: with a thread per waiting prefill, a burst of
        push requests once took every thread, and the registrations they waited for starved."""
        aio = asyncio.get_running_loop()
        finished = asyncio.Event()
        job.on_finished.append(lambda: aio.call_soon_threadsafe(finished.set))
        if not job.finished.is_set():
            await asyncio.wait_for(finished.wait(), 4 * self.connector.cfg.kv_timeout_s)

    async def register(self, request: Request) -> JSONResponse:
        body = await control_body(request, self.secret)
        for key in ("handoff_id", "agent_metadata", "block_ids", "num_kv_tokens", "prompt_hash", "ttl_ms"):
            if key not in body:
                raise P.APIError(400, f"registration lacks {key!r}")
        aio = asyncio.get_running_loop()
        try:
            peer = await aio.run_in_executor(self.pool, self.connector.ensure_peer, body["agent_metadata"])
            self.connector.register(body, peer)
        except HandoffError as exc:
            raise P.APIError(exc.status, str(exc), type="handoff_error") from None
        return JSONResponse({"status": "registered"})

    # ---- decode side ----------------------------------------------------------------------------
    async def submit_decode(self, kv: KVRequest, stream: RequestStream, prompt_ids: list[int],
                            params: SamplingParams) -> None:
        aio = asyncio.get_running_loop()
        try:
            if kv.mode in PULL_MODES:
                peer = await aio.run_in_executor(self.pool, self.connector.ensure_peer, kv.remote["agent_metadata"])
            else:
                peer = await self._prefill_peer(kv.prefill_url)
        except HandoffError as exc:
            raise P.APIError(exc.status, str(exc), type="handoff_error") from None

        def register(incoming) -> None:    # engine thread: blocks reserved, tell the prefill worker
            body = self.connector.registration(incoming, kv.mode, prompt_ids)
            aio.call_soon_threadsafe(lambda: asyncio.ensure_future(self._register(kv, body)))
        try:
            self.connector.submit_decode(kv.handoff_id, kv.mode, prompt_ids, params, stream._on_output,
                                         remote=kv.remote, peer=peer, register=register, retain=kv.retain,
                                         supersedes=kv.supersedes)
        except HandoffError as exc:
            raise P.APIError(exc.status, str(exc), type="handoff_error") from None
        except ValueError as exc:
            raise P.APIError(400, str(exc)) from None

    async def _prefill_peer(self, url: str) -> str:
        peer = self.peer_info.get(url)
        if peer is None:
            try:
                info = (await self.http.get(f"{url}/kv/info")).raise_for_status().json()
            except httpx.HTTPError as exc:
                raise HandoffError(f"prefill worker {url} unreachable: {exc}", 502) from None
            peer = await asyncio.get_running_loop().run_in_executor(self.pool, self.connector.ensure_peer,
                                                                    info["agent_metadata"])
            self.peer_info[url] = peer
        return peer

    async def _register(self, kv: KVRequest, body: dict) -> None:
        try:
            r = await self.http.post(f"{kv.prefill_url}/kv/register", json=body)
            if r.status_code >= 400:
                try:
                    reason = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    reason = f"{r.status_code} {r.text[:200]}"
                self.connector.fail_incoming(kv.handoff_id, f"prefill refused the registration: {reason}")
            else:
                self.connector.cfg.faults.reached("registered", kv.handoff_id)
        except httpx.HTTPError as exc:
            # It may or may not have arrived: keep the blocks aside until the push deadline passes.
            self.connector.fail_incoming(kv.handoff_id, f"registration with {kv.prefill_url} failed: {exc}",
                                         settled=False)

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _observe(self, role: str, total_ms: float | None, nbytes: int | None) -> None:
        if total_ms is not None:
            self.handoff_seconds.labels(role).observe(total_ms / 1000)
        if nbytes:
            self.handoff_bytes.labels(role).observe(nbytes)

    def sync_counters(self) -> None:
        """Fold the connector's counters into Prometheus (called on scrape)."""
        for key in ("failures", "lease_expiries", "late_notifications", "verify_failures"):
            now = self.connector.counters[key]
            if now > self._seen[key]:
                self.events.labels(key).inc(now - self._seen[key])
                self._seen[key] = now
        retention = self.connector.retention
        if retention is not None:
            stats = retention.stats()
            self.retained_sessions.set(stats["num_retained_sessions"])
            self.retained_bytes.set(stats["retained_bytes"])
            for key in ("expiries", "evictions", "superseded", "reuse_hits"):
                now = retention.counters[key]
                if now > self._seen_retention[key]:
                    self.retention_events.labels(key).inc(now - self._seen_retention[key])
                    self._seen_retention[key] = now

    def info(self) -> dict:
        c = self.connector
        return {"worker": c.worker_name, "role": self.role, "agent_metadata": c.metadata_b64(),
                "block_size": c.engine.block_size, "block_bytes": c.layout.block_bytes,
                "num_layers": c.layout.num_layers, "layer_bytes": c.layout.layer_bytes,
                "dtype": str(c.engine.dtype).removeprefix("torch."), "model": c.engine.served_name}


async def control_body(request: Request, secret: bytes, key: str = "handoff_id") -> dict:
    """An authenticated /kv/* message: a JSON object naming a `key` string, or a 400 (never a 500)."""
    check_control(request, secret)
    try:
        body = await request.json()
    except ValueError:
        raise P.APIError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict) or not isinstance(body.get(key), str):
        raise P.APIError(400, f"the body must be a JSON object with a string {key}", param=key)
    return body


def attach_worker_routes(app: FastAPI, handoff: WorkerHandoff) -> None:
    server = handoff.server
    server.handoff = handoff

    @app.get("/kv/info")
    async def kv_info(request: Request):
        check_control(request, handoff.secret)
        return handoff.info()

    @app.post("/kv/register")
    async def kv_register(request: Request):
        if handoff.role != "prefill":
            raise P.APIError(400, "registrations go to prefill workers")
        return await handoff.register(request)

    @app.post("/kv/release")
    async def kv_release(request: Request):
        body = await control_body(request, handoff.secret)
        released = handoff.connector.release_lease(body["handoff_id"])
        return {"released": released}

    @app.post("/kv/failed")
    async def kv_failed(request: Request):
        """Decode side: the router saw this handoff's prefill fail (push). Usually the prefill worker
        says so itself over the notification channel; this path covers a prefill that died or whose
        channel is what broke, so decode acts now instead of after --kv-timeout-s."""
        body = await control_body(request, handoff.secret)
        if handoff.role != "decode":
            raise P.APIError(400, "failure reports go to decode workers")
        reason = str(body.get("reason") or "the prefill failed")[:500]
        # settled only when the prefill answered: a worker that answers has no WRITE left in flight
        # (it waits for its WRITE before answering); one that vanished mid-request might.
        recompute = body.get("recompute")      # the router may ask for a recompute whatever our policy
        failed = handoff.connector.fail_incoming(body["handoff_id"], f"router reported: {reason}",
                                                 settled=bool(body.get("prefill_answered")),
                                                 recompute=recompute if isinstance(recompute, bool) else None)
        return {"failed": failed}

    @app.post("/kv/cancel")
    async def kv_cancel(request: Request):
        """The router gave up on a handoff (its client left): free what this worker holds for it."""
        body = await control_body(request, handoff.secret)
        handoff_id = body["handoff_id"]
        handoff.connector.cancel(handoff_id)
        return {"cancelled": handoff_id}

    @app.post("/kv/retained/lease")
    async def kv_retained_lease(request: Request):
        """Bidirectional, decode side: a prefill worker wants to READ a retained conversation's first
        `num_blocks` blocks. Holds them in place until it reports back (or the read lease lapses)."""
        body = await control_body(request, handoff.secret, key="retention_id")
        num_blocks = body.get("num_blocks")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise P.APIError(400, "num_blocks must be a positive integer", param="num_blocks")
        aio = asyncio.get_running_loop()
        lease = await aio.run_in_executor(handoff.pool, handoff.connector.lease_retained, body["retention_id"],
                                          num_blocks)
        if lease is None:
            raise P.APIError(410, f"no retained KV {body['retention_id']!r} with {num_blocks} blocks here (expired, "
                             "evicted or never kept)", type="handoff_error", code="retained_kv_gone")
        return lease

    @app.post("/kv/retained/release")
    async def kv_retained_release(request: Request):
        """Bidirectional, decode side: the router says this retained conversation will not be read."""
        body = await control_body(request, handoff.secret, key="retention_id")
        aio = asyncio.get_running_loop()
        released = await aio.run_in_executor(handoff.pool, handoff.connector.release_retained, body["retention_id"])
        return {"released": released}

    @app.post("/kv/prompt")
    async def kv_prompt(request: Request):
        """Bidirectional: the block hashes a request's prompt has here, so the router can find a
        conversation's retained KV for a client that names no session. Body: {"endpoint": the OpenAI
        path, "request": the client's body}."""
        check_control(request, handoff.secret)
        try:
            body = await request.json()
        except ValueError:
            raise P.APIError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
            raise P.APIError(400, "the body must be {\"endpoint\": ..., \"request\": {...}}")
        chat = body.get("endpoint") == CHAT
        try:
            parsed = (P.ChatCompletionRequest if chat else P.CompletionRequest).model_validate(body["request"])
        except ValidationError as exc:
            raise P.APIError(400, f"not a valid request: {exc.errors()[0].get('msg')}") from None
        ids = server.chat_prompt(parsed) if chat else server.completion_prompt(parsed)
        hashes = hash_chain(ids, handoff.connector.engine.block_size)
        return {"num_tokens": len(ids), "block_hashes": [h.hex() for h in hashes]}
