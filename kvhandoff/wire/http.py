"""How every kvhandoff process speaks HTTP, router and worker alike: the public endpoints' paths, SSE
framing, the one body check (a JSON object or a 400 that says what is wrong), streamed answers that
clean up however they end, the latency buckets of both /metrics, and the uvicorn runner."""
from __future__ import annotations

import socket
from typing import AsyncIterator, Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from kvhandoff.wire import api as P
from kvhandoff.wire.channel import ChannelServer

# 1 ms .. 60 s: TPOT on a fast GPU is a few ms, a long CPU prefill under load can take tens of seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)


CONTENT_TYPE = CONTENT_TYPE_LATEST       # of /metrics


SERVER_KEEP_ALIVE_S = 75          # idle keep-alive connections (see serve_forever)


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


async def wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is http.disconnect, whenever the client leaves.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse_event(obj: dict) -> str:
    # msgspec: compact, UTF-8 unescaped like json.dumps(ensure_ascii=False), ~7x faster (every chunk a
    # worker streams and every final one the router rewrites); floats in shortest form (1.5e-7).
    return f"data: {msgspec.json.encode(obj).decode()}\n\n"


class StreamingAnswer(StreamingResponse):
    """A streamed response that runs `on_close` however it ends. The body generator's own `finally`
    is not enough: if the client leaves before the body starts, the generator never runs."""

    def __init__(self, body: AsyncIterator, media_type: str, on_close: Callable[[], None]):
        super().__init__(body, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class SSEResponse(StreamingAnswer):
    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(body, "text/event-stream", on_close)


def describe(exc: BaseException) -> str:
    """An exception in a message for a log line or a client: its text, or its type when it has none
    (httpx and aiohttp raise some with an empty message)."""
    return str(exc) or type(exc).__name__


async def read_json_object(request: Request) -> dict:
    """The body as a JSON object, or one 400 that says what is wrong with it: the one body check of
    the public endpoints, the router's and the control endpoints (any Content-Type is accepted: curl
    -d sends form-urlencoded)."""
    raw = await request.body()
    if not raw.strip():
        raise P.APIError(400, "the request body is empty; send a JSON object")
    try:
        data = msgspec.json.decode(raw)     # (~4x the standard library's: every request's body, at the router)
    except msgspec.DecodeError as e:
        raise P.APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise P.APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    return data


async def parse_body(request: Request, cls: type[BaseModel]) -> BaseModel:
    """Parse and validate a JSON body ourselves rather than through FastAPI's body parameters: every
    failure becomes one 400 whose message names the field."""
    data = await read_json_object(request)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise P.APIError(400, message, param=param) from None


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """Turn pydantic's errors into one sentence naming the field(s), and the first field as `param`."""
    if errors and errors[0].get("type") == "json_invalid":
        detail = (errors[0].get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    by_path: dict[str, list[str]] = {}
    for err in errors:
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        by_path.setdefault(field_path(err.get("loc", ())), []).append(msg)
    messages = []
    for path, msgs in by_path.items():
        # A union reports one error per member: "Input should be a valid string or a valid list".
        msg = msgs[0] + "".join(" or " + m.removeprefix("Input should be ") for m in msgs[1:])
        if not path:
            msg = f"request body: {msg}"
        elif not msg.startswith(path.split(".")[0].split("[")[0]):
            msg = f"{path}: {msg}"
        messages.append(msg)
    return "; ".join(messages[:3]) or "invalid request", next(iter(by_path), None) or None


def field_path(loc) -> str:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content' (drops union-member tags)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none"):
            continue                   # pydantic names the union member it tried; not a field
        else:
            out += f".{part}" if out else part
    return out


def endpoint_label(request: Request) -> str:
    path = request.url.path
    return path if path in (COMPLETIONS, CHAT) else "other"


def listener(host: str, port: int, shared: bool = False) -> socket.socket:
    """A listening TCP socket. `shared`: on a port other processes of this user bind too
    (SO_REUSEPORT): the kernel spreads new connections over them, so several routers serve one front
    address with no balancer in between, and a router that dies leaves the port to the others."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        what = " (shared with other routers: is a process of another kind, or another user's, on it?)" if shared else ""
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}{what}") from None
    sock.listen(2048)
    return sock


def serve_forever(app: FastAPI, host: str, port: int, *, log_level: str = "info",
                  on_ready: Callable[[str], None] | None = None, shared_port: int | None = None,
                  channel_secret: bytes | None = None) -> None:
    """Run uvicorn in this thread until SIGINT/SIGTERM. On shutdown, in-flight generations are
    aborted first so open streams end at once instead of holding shutdown hostage. `shared_port`:
    listen there too, shared with other processes (listener); `on_ready` gets the own port's URL.
    `channel_secret`: also serve the app on a persistent channel (wire/channel.py) to routers holding
    this deployment's control token, on a free port of `host` that /health names (app.state.channel_port)."""
    import uvicorn

    channel = ChannelServer(app, channel_secret) if channel_secret else None

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started and channel is not None:
                # (the address uvicorn bound: "localhost" may name two, which port 0 would split)
                app.state.channel_port = await channel.start(self.servers[0].sockets[0].getsockname()[0])
            if self.started and on_ready:
                sock = self.servers[0].sockets[0].getsockname()
                h = sock[0] if ":" not in sock[0] else f"[{sock[0]}]"
                on_ready(f"http://{h}:{sock[1]}")   # the real port, also when asked for port 0

        async def shutdown(self, sockets=None):
            if channel is not None:
                channel.close()
            server = getattr(app.state, "server", None)
            if server is not None:
                server.abort_all()
            await super().shutdown(sockets)

    # Idle keep-alive connections live longer here than in any client's pool (httpx drops them after
    # 5 s): a server that closes an idle connection just as a client reuses it fails that request with
    # a ReadError (seen once under load between the router and a decode worker at uvicorn's 5 s).
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            timeout_keep_alive=SERVER_KEEP_ALIVE_S, access_log=log_level == "debug")
    if shared_port is None:
        _Server(config).run()
        return
    _Server(config).run(sockets=[listener(host, port), listener(host, shared_port, shared=True)])

