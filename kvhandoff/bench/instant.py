"""A worker that answers at once: the router benchmark's stand-in for prefill and decode workers.

It speaks the workers' side of the wire contract (docs/HANDOFF.md) with no engine behind it: a prefill
answers its JSON lines (the first token, then a handoff object) the moment the request is read; a
decode worker streams its answer (a chat stream's role chunk, one event per token with its
EventNote, the final chunk, [DONE]) without waiting for anything. So what the router benchmark
measures is the router's own cost. Run as `python -m kvhandoff.bench.instant --role decode --port N`;
aiohttp on uvloop, one process, far cheaper per request than the router it serves.
"""
from __future__ import annotations

import argparse
import time

import msgspec
import uvloop
from aiohttp import web

from kvhandoff.wire import messages as M

PHASES = {"prefill_queue": 0.0, "prefill_compute": 0.0}


def chunk(rid: str, chat: bool, text: str, finish: str | None = None, **extra) -> dict:
    choice = {"index": 0, "logprobs": None, "finish_reason": finish,
              **({"delta": {"content": text} if text else {}} if chat else {"text": text})}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
            "model": "instant", "choices": [choice], **extra}


def role_chunk(rid: str) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": 0, "model": "instant",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]}


def event(obj: dict, note: M.EventNote | None = None) -> bytes:
    return (note.line().encode() if note else b"") + b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def generate(request: web.Request) -> web.StreamResponse:
    count(request)
    body = msgspec.json.decode(await request.read())
    kv = body.get("kv_transfer_params") or {}
    chat = request.path.endswith("/chat/completions")
    rid = kv.get("handoff_id") or "instant"
    if kv.get("role") == "prefill":
        return await prefill(request, kv, chat, rid)
    return await decode(request, body, kv, chat, rid)


async def prefill(request: web.Request, kv: dict, chat: bool, rid: str) -> web.StreamResponse:
    started = time.perf_counter()
    resp = web.StreamResponse(headers={"content-type": "application/x-ndjson"})
    await resp.prepare(request)
    sse = (event(role_chunk(rid)).decode() if chat else "") + event(chunk(rid, chat, " t0")).decode()
    phases = PHASES | {"prefill_worker": round((time.perf_counter() - started) * 1e3, 3)}
    first = M.FirstToken(token_id=0, text=" t0", sse=sse, phases_ms=phases)
    await resp.write(b'{"first_token":' + M.encode(first) + b"}\n")
    answer = {"handoff_id": rid, "prefill_worker": "instant", "num_kv_tokens": 1, "blocks": 1, "phases_ms": PHASES}
    if kv.get("mode", "").startswith("pull"):
        answer |= {"prompt_token_ids": [1], "block_ids": [0], "pool_blocks": 1, "checksums": [0], "agent_metadata": "",
                   "first_token_id": 0}
    await resp.write(msgspec.json.encode({"handoff": answer}) + b"\n")
    await resp.write_eof()
    return resp


async def decode(request: web.Request, body: dict, kv: dict, chat: bool, rid: str) -> web.StreamResponse:
    n = int(body.get("max_tokens") or 16)
    if not body.get("stream"):
        text = "".join(f" t{i}" for i in range(n))
        answer = chunk(rid, chat, text, "length") | {"usage": {"prompt_tokens": 1, "completion_tokens": n}}
        if chat:
            answer["choices"][0] = {"index": 0, "message": {"role": "assistant", "content": text},
                                    "finish_reason": "length"}
        answer |= {"timings": {"ttft_ms": 0.0}, "handoff": report(rid, kv)} if kv else {}
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    noted = bool(kv)
    parts, chars = [], 0
    if chat:
        parts.append(event(role_chunk(rid), M.EventNote([], 0, frozenset({"head"})) if noted else None))
    for i in range(n):
        text = f" t{i}"
        chars += len(text)
        last = i == n - 1
        tags = ({"first"} if i == 0 and not kv.get("resume_token_ids") else set()) | ({"final"} if last else set())
        extra = {"timings": {"ttft_ms": 0.0}, **({"handoff": report(rid, kv)} if kv else {})} if last else {}
        parts.append(event(chunk(rid, chat, text, "length" if last else None, **extra),
                           M.EventNote([i], chars, frozenset(tags)) if noted else None))
    parts.append(b"data: [DONE]\n\n")
    await resp.write(b"".join(parts))
    await resp.write_eof()
    return resp


def report(rid: str, kv: dict) -> dict:
    return {"handoff_id": rid, "mode": kv.get("mode"), "decode_worker": "instant", "bytes_transferred": 0, "blocks": 1,
            "decode_cached_tokens": 0, "kv_source": "remote",
            "phases_ms": {"handoff_wait": 0.0, "transfer": 0.0, "decode_queue": 0.0, "first_step": 0.0}}


def count(request: web.Request) -> None:
    """Requests served, by path: the router benchmark reports how many each client request cost."""
    counts = request.app["counts"]
    counts[request.path] = counts.get(request.path, 0) + 1


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "role": request.app["role"], "num_running": 0, "num_waiting": 0,
                              "served": request.app["counts"]})


async def control(request: web.Request) -> web.Response:
    count(request)
    await request.read()
    return web.json_response({})


def app(role: str) -> web.Application:
    application = web.Application()
    application["role"] = role
    application["counts"] = {}
    application.router.add_post("/v1/completions", generate)
    application.router.add_post("/v1/chat/completions", generate)
    application.router.add_get("/health", ok)
    for path in ("/kv/cancel", "/kv/release", "/kv/failed", "/kv/retained/release"):
        application.router.add_post(path, control)
    return application


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    uvloop.install()
    print(f"instant {args.role} worker at http://127.0.0.1:{args.port}", flush=True)
    web.run_app(app(args.role), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
