"""A worker that answers at once: the router benchmark's stand-in for prefill and decode workers.

It speaks the workers' side of the wire contract (docs/HANDOFF.md) with no engine behind it: a prefill
answers its JSON lines (the first token, then a handoff object) the moment the request is read; a
decode worker streams its answer (a chat stream's role chunk, one event per token with its
EventNote, the final chunk, [DONE]) without waiting for anything. So what the router benchmark
measures is the router's own cost. Run as `python -m kvhandoff.bench.instant --role decode --port N`;
aiohttp on uvloop, one process, far cheaper per request than the router it serves.

With `--ports P1,P2,...` one process serves many workers (the router benchmark's `--workers N`), each
with what a real one would hold: an LRU of prefix-cache blocks (`--capacity` of them) that every prompt
it prefills refreshes and fills, evicting the oldest, and on a decode worker the conversations it
keeps (one retained turn per session the router names), published as the real workers publish them
(KV events: kvhandoff/worker/kv_events.py, with the same secret), so that the router indexes a fleet
of that size at the events' natural rate.
"""
from __future__ import annotations

import argparse
import os
import threading
import time
from collections import OrderedDict

import msgspec
import uvloop
from aiohttp import web

from kvhandoff.engine.block_pool import REMOVED, STORED, hash_chain
from kvhandoff.wire import messages as M
from kvhandoff.wire.modes import ROLES, Role
from kvhandoff.worker.kv_events import RETAINED, UNRETAINED, Publisher

BLOCK_SIZE = 32
RETENTION_TTL_S = 480.0


class Holdings:
    """What one instant worker holds, published as KV events (an LRU of prefix blocks; retained turns)."""

    def __init__(self, secret: bytes, capacity: int, publish: bool = True):
        self.capacity = capacity
        self.lock = threading.Lock()            # (the publisher's thread takes snapshots)
        self.blocks: OrderedDict[bytes, tuple] = OrderedDict()
        self.retained: dict[str, tuple] = {}    # session -> its RETAINED event
        self.publisher = None
        if publish:         # (without: routers ask it instead, /kv/prompt and /kv/retained/find, as before events)
            self.publisher = Publisher(secret, "127.0.0.1", BLOCK_SIZE, "CPU", lambda fn: fn(), self.snapshot)
            self.publisher.start()

    def publish(self, events: list[tuple]) -> None:
        if self.publisher is not None:
            self.publisher.publish(events)

    def cached_blocks(self, ids: list[int]) -> tuple[list[bytes], int]:
        """The prompt's chain and how many of its leading blocks are held (what /kv/prompt answers)."""
        hashes = hash_chain(ids, BLOCK_SIZE)
        with self.lock:
            held = next((i for i, h in enumerate(hashes) if h not in self.blocks), len(hashes))
        return hashes, held

    def prefilled(self, ids: list[int]) -> None:
        events, parent = [], None
        with self.lock:
            for i, h in enumerate(hash_chain(ids, BLOCK_SIZE)):
                if h in self.blocks:
                    self.blocks.move_to_end(h)
                else:
                    self.blocks[h] = event = (STORED, h, parent, tuple(ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
                    events.append(event)
                parent = h
            while len(self.blocks) > self.capacity:
                events.append((REMOVED, self.blocks.popitem(last=False)[0]))
            if events:
                self.publish(events)

    def kept(self, session: str, ids: list[int]) -> dict:
        """A decode turn kept for its session (the previous one let go); what the router is told."""
        retention_id = f"{session}-{len(ids)}"
        hashes = hash_chain(ids, BLOCK_SIZE)
        full = ids[:len(hashes) * BLOCK_SIZE]
        with self.lock:
            events = [(RETAINED, retention_id, session, hashes, full)]
            old = self.retained.get(session)
            if old is not None:
                events.insert(0, (UNRETAINED, old[1], old[3]))
            self.retained[session] = events[-1]
            self.publish(events)
        return {"retention_id": retention_id, "num_tokens": len(full), "block_hashes": [h.hex() for h in hashes],
                "expires_in_s": RETENTION_TTL_S, "bytes": 0, "session": session}

    def snapshot(self) -> list[tuple]:
        with self.lock:
            return list(self.blocks.values()) + list(self.retained.values())

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
    request["prompt"] = body.get("prompt")
    kv = body.get("kv_transfer_params") or {}
    chat = request.path.endswith("/chat/completions")
    rid = kv.get("handoff_id") or "instant"
    if kv.get("role") == Role.PREFILL:
        return await prefill(request, kv, chat, rid)
    return await decode(request, body, kv, chat, rid)


async def prefill(request: web.Request, kv: dict, chat: bool, rid: str) -> web.StreamResponse:
    started = time.perf_counter()
    holdings, prompt = request.app["holdings"], request["prompt"]
    if holdings is not None and isinstance(prompt, list):
        holdings.prefilled(prompt)
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
        answer |= {"timings": {"ttft_ms": 0.0}, "handoff": report(request, rid, kv)} if kv else {}
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
        extra = {"timings": {"ttft_ms": 0.0}, **({"handoff": report(request, rid, kv)} if kv else {})} if last else {}
        parts.append(event(chunk(rid, chat, text, "length" if last else None, **extra),
                           M.EventNote([i], chars, frozenset(tags)) if noted else None))
    parts.append(b"data: [DONE]\n\n")
    await resp.write(b"".join(parts))
    await resp.write_eof()
    return resp


def report(request: web.Request, rid: str, kv: dict) -> dict:
    answer = {"handoff_id": rid, "mode": kv.get("mode"), "decode_worker": "instant", "bytes_transferred": 0,
              "blocks": 1, "decode_cached_tokens": 0, "kv_source": "remote",
              "phases_ms": {"handoff_wait": 0.0, "transfer": 0.0, "decode_queue": 0.0, "first_step": 0.0}}
    holdings, prompt, session = request.app["holdings"], request["prompt"], kv.get("session")
    if holdings is not None and kv.get("retain") and session and isinstance(prompt, list):
        answer["retained"] = holdings.kept(session, prompt)
    return answer


def count(request: web.Request) -> None:
    """Requests served, by path: the router benchmark reports how many each client request cost."""
    counts = request.app["counts"]
    counts[request.path] = counts.get(request.path, 0) + 1


async def prompt_facts(request: web.Request) -> web.Response:
    """/kv/prompt: what a router without events asks of every prefill worker on a request's path."""
    count(request)
    query = msgspec.json.decode(await request.read())
    prompt = (query.get("request") or {}).get("prompt")
    if not isinstance(prompt, list) or request.app["holdings"] is None:
        return web.json_response({"error": {"message": "token-id prompts only"}}, status=400)
    hashes, held = request.app["holdings"].cached_blocks(prompt)
    return web.json_response({"num_tokens": len(prompt), "block_size": BLOCK_SIZE,
                              "block_hashes": [h.hex() for h in hashes], "cached_blocks": held})


async def retained_find(request: web.Request) -> web.Response:
    """/kv/retained/find: what a router without events asks of every decode worker on a turn's path."""
    count(request)
    query = msgspec.json.decode(await request.read())
    holdings = request.app["holdings"]
    kept = holdings.retained.get(query.get("session")) if holdings is not None else None
    if kept is None:
        return web.json_response({"retained": None})
    _, retention_id, session, hashes, full = kept
    return web.json_response({"retained": {"retention_id": retention_id, "num_tokens": len(full),
                                           "block_hashes": [h.hex() for h in hashes], "expires_in_s": RETENTION_TTL_S,
                                           "bytes": 0, "session": session, "matched_blocks": len(hashes)}})


async def ok(request: web.Request) -> web.Response:
    holdings = request.app["holdings"]
    events = {} if holdings is None else {"num_blocks": holdings.capacity}
    if holdings is not None and holdings.publisher is not None:
        events["kv_events"] = holdings.publisher.health(RETENTION_TTL_S, "")
    return web.json_response({"status": "ok", "role": request.app["role"], "num_running": 0, "num_waiting": 0,
                              "served": request.app["counts"], **events})


async def control(request: web.Request) -> web.Response:
    count(request)
    await request.read()
    return web.json_response({})


def app(role: Role, holdings: Holdings | None = None) -> web.Application:
    application = web.Application()
    application["role"] = role
    application["counts"] = {}
    application["holdings"] = holdings
    application.router.add_post("/v1/completions", generate)
    application.router.add_post("/v1/chat/completions", generate)
    application.router.add_get("/health", ok)
    for path in ("/kv/cancel", "/kv/release", "/kv/failed", "/kv/retained/release"):
        application.router.add_post(path, control)
    application.router.add_post("/kv/prompt", prompt_facts)
    application.router.add_post("/kv/retained/find", retained_find)
    return application


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", type=Role, choices=ROLES, required=True)
    p.add_argument("--port", type=int, help="one worker on this port")
    p.add_argument("--ports", help="several workers in this process, one per port (comma-separated)")
    p.add_argument("--capacity", type=int, default=0,
                   help="publish KV events (needs $KVHANDOFF_SECRET) for a prefix cache of this many blocks")
    p.add_argument("--no-events", action="store_true",
                   help="with --capacity: publish nothing (routers ask: /kv/prompt, /kv/retained/find)")
    args = p.parse_args()
    ports = [args.port] if args.port else [int(x) for x in (args.ports or "").split(",") if x]
    if not ports:
        p.error("--port or --ports")
    uvloop.install()
    secret = os.environ.get("KVHANDOFF_SECRET", "").encode()
    if args.capacity and not secret:
        p.error("--capacity: KV events need the deployment secret ($KVHANDOFF_SECRET)")
    web.run_app(serve(args.role, ports, args.capacity, secret, not args.no_events), host="127.0.0.1", port=ports[0],
                print=None, access_log=None)


async def serve(role: Role, ports: list[int], capacity: int, secret: bytes, publish: bool) -> web.Application:
    """Every port's app on one loop (web.run_app runs the first; the others are started here)."""
    apps = [app(role, Holdings(secret, capacity, publish) if capacity else None) for _ in ports]
    for application, port in zip(apps[1:], ports[1:]):
        runner = web.AppRunner(application, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"instant {role} workers at " + ", ".join(f"http://127.0.0.1:{port}" for port in ports), flush=True)
    return apps[0]


if __name__ == "__main__":
    main()
