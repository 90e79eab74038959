"""The router's admin endpoints: the worker set changed at run time, behind the deployment's control token.

GET /admin/workers lists the pool; POST /admin/workers {"role": "prefill"|"decode", "url": ...} adds a
worker (checked with one /health at once: it serves when that answers, or when a later poll does;
`"instance": ID` from a worker that adds itself, `serve --join`: forgotten once unreachable for long,
and that run of it refused once drained);
GET /admin/kv-index?url=... shows what the router's KV-event index holds of a worker (without url: its
size, what it absorbed, its lookups' durations) (worker/handoff.py's
/kv/held shows what the worker holds: the two agree while its events are fresh);
DELETE /admin/workers?url=... drains one (no new requests; it leaves the pool after its last request).
`kvhandoff workers` is the command line for them. A worker that restarts at the same URL (`kvhandoff
up` restarting a dead one) needs none of this: the health poll takes it back.
"""
from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from kvhandoff.router.pool import Worker, parse_urls
from kvhandoff.wire import api as P
from kvhandoff.wire.auth import check_control
from kvhandoff.wire.http import read_json_object
from kvhandoff.wire.modes import ROLES, Role

log = logging.getLogger("kvhandoff.router")


def listing(worker: Worker) -> dict:
    """What the router knows of a worker; `step_ms` and `num_free_blocks` are from its last /health
    poll (None until one answered)."""
    return {"url": worker.url, "role": worker.role, "healthy": worker.healthy, "draining": worker.draining,
            "in_flight": worker.in_flight, "joined": worker.joined, "step_ms": worker.last_health.get("step_ms"),
            "num_free_blocks": worker.last_health.get("num_free_blocks")}


def one_url(raw) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise P.APIError(400, "url must be a worker's base URL, e.g. http://127.0.0.1:8101", param="url")
    try:
        urls = parse_urls(raw)
    except ValueError as e:
        raise P.APIError(400, str(e), param="url") from None
    if len(urls) != 1:
        raise P.APIError(400, f"one worker URL at a time, not {len(urls)}", param="url")
    return urls[0]


async def list_workers(router, request: Request) -> JSONResponse:
    check_control(request, router.config.secret)
    return JSONResponse({"workers": [listing(w) for w in router.pool.workers]})


async def add_worker(router, request: Request) -> JSONResponse:
    check_control(request, router.config.secret)
    body = await read_json_object(request)
    role = body.get("role")
    if role not in ROLES:
        raise P.APIError(400, f"role must be one of {', '.join(ROLES)}, not {role!r}", param="role")
    url = one_url(body.get("url"))
    instance = body.get("instance")
    if instance is not None and (not isinstance(instance, str) or not 0 < len(instance) <= 64):
        raise P.APIError(400, "instance must be a string of 1-64 characters naming this run of a worker that "
                         "joins by itself", param="instance")
    try:
        worker = router.pool.add(Role(role), url, instance=instance)
    except ValueError as e:
        raise P.APIError(409, str(e), param="url") from None
    report = await router.pool.check(router.upstream, worker)
    log.info("added %s (%s)", worker, "healthy" if worker.healthy else f"not healthy yet: {report.get('status')}")
    return JSONResponse({"worker": listing(worker), "health": report})


async def remove_worker(router, request: Request) -> JSONResponse:
    check_control(request, router.config.secret)
    url = one_url(request.query_params.get("url"))
    try:
        worker = router.pool.remove(url)
    except KeyError:
        raise P.APIError(404, f"no worker {url} in the pool", param="url") from None
    except ValueError as e:
        raise P.APIError(409, str(e), param="url") from None
    if worker.in_flight:
        log.info("draining %s: %d request(s) still in flight, no new ones", worker, worker.in_flight)
    else:
        log.info("removed %s", worker)
    return JSONResponse({"worker": listing(worker), "removed": worker.in_flight == 0})


async def kv_index(router, request: Request) -> JSONResponse:
    check_control(request, router.config.secret)
    sessions = router.index.sessions            # (ours; None in front of vLLM's workers)
    if request.query_params.get("url") is None:
        return JSONResponse(router.index.stats() | {"retained_turns": len(sessions.map) if sessions else 0})
    url = one_url(request.query_params.get("url"))
    retained = sorted(e.retention_id for e in sessions.map.entries.values() if e.decode_url == url) if sessions else []
    return JSONResponse({"url": url, "fresh": router.feeds.fresh(url), "blocks": sorted(k.hex() for k in
                         router.index.held(url)), "retained": retained})


def install(app, router) -> None:
    async def answer(handler, request: Request) -> JSONResponse:
        try:
            return await handler(router, request)
        except P.APIError as e:                      # 400/401/404/409: the caller's to fix
            return JSONResponse(e.body(), status_code=e.status)

    @app.get("/admin/workers")
    async def get_workers(request: Request):
        return await answer(list_workers, request)

    @app.post("/admin/workers")
    async def post_worker(request: Request):
        return await answer(add_worker, request)

    @app.get("/admin/kv-index")
    async def get_kv_index(request: Request):
        return await answer(kv_index, request)

    @app.delete("/admin/workers")
    async def delete_worker(request: Request):
        return await answer(remove_worker, request)
