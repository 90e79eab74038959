"""The persistent channel between a router and its workers (issue 46; wire/channel.py, router/channel.py):
over real sockets, a leg is the same HTTP exchange it would be, authenticated once; a wrong token or
a stranger is refused; a slow leg holds back only itself; a leg closed half-read or a dead connection
is seen by both ends; and the router's Upstream picks the channel a worker offers, and HTTP when it
cannot be had. Through `kvhandoff up`, test_fleet.py checks that a stack's legs take it."""
from __future__ import annotations

import asyncio
import logging
import socket
import struct

import msgspec
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter

from kvhandoff.router.answer import Broken
from kvhandoff.router.channel import Channel, ChannelRefused
from kvhandoff.router.upstream import Upstream
from kvhandoff.wire.auth import control_headers, control_token
from kvhandoff.wire.channel import VERSION, WINDOW, ChannelServer, Kind

SECRET = b"channel-test-secret"
TOKEN = control_token(SECRET)
CHUNK = 64 << 10


def app_under_test() -> FastAPI:
    """Echoes, streams numbered chunks (counting what it sent), and notes when its client left."""
    app = FastAPI()
    app.state.sent = 0
    app.state.left = asyncio.Event()

    @app.post("/echo")
    async def echo(request: Request):
        return {"body": msgspec.json.decode(await request.body()), "query": request.url.query,
                "authorization": request.headers.get("authorization"), "tag": request.headers.get("x-tag")}

    @app.get("/stream")
    async def stream(chunks: int):
        async def body():
            try:
                for n in range(chunks):
                    yield bytes([n % 251]) * CHUNK
                    app.state.sent += CHUNK
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                app.state.left.set()
                raise
        return StreamingResponse(body(), media_type="application/octet-stream")

    @app.get("/lines")
    async def lines():
        async def body():
            yield b'{"a": 1}\n{"b":'
            yield b' 2}\n'
            await asyncio.sleep(3600)
        return StreamingResponse(body(), media_type="application/x-ndjson")

    return app


async def served(app, secret=SECRET) -> tuple[ChannelServer, int]:
    server = ChannelServer(app, secret)
    return server, await server.start("127.0.0.1")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def until(condition, timeout: float = 5.0) -> None:
    """Poll `condition` until it holds or `timeout` passes (a slow machine, not a fixed sleep)."""
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)


def test_a_leg_is_the_http_exchange_it_stands_for():
    async def main():
        app = app_under_test()
        server, port = await served(app)
        channel = await Channel.connect("127.0.0.1", port, TOKEN, 5.0)
        answer = await channel.open("POST", "/echo?x=1", [["content-type", "application/json"], ["x-tag", "t"]],
                                    msgspec.json.encode({"n": [1, 2, 3]}), None)
        assert answer.status == 200 and answer.content_type == "application/json"
        echoed = msgspec.json.decode(await answer.read())
        # The app sees the connection's control token on every leg, whatever the frame carried.
        assert echoed == {"body": {"n": [1, 2, 3]}, "query": "x=1", "authorization": f"Bearer {TOKEN}", "tag": "t"}
        missing = await channel.open("GET", "/nowhere", [], b"", None)
        assert missing.status == 404
        await missing.read()
        lines = await channel.open("GET", "/lines", [], b"", 0.5)
        seen = []
        with pytest.raises(Broken, match="timed out"):     # (the exchange's deadline, as HTTP's total timeout)
            async for line in lines.lines():
                seen.append(line)
        assert seen == [b'{"a": 1}\n', b'{"b": 2}\n']
        assert not channel.legs
        channel.close()
        server.close()
    run(main())


def test_a_wrong_token_or_a_stranger_is_refused():
    async def main():
        server, port = await served(app_under_test())
        with pytest.raises(ChannelRefused, match="wrong control token"):
            await Channel.connect("127.0.0.1", port, control_token(b"another deployment"), 5.0)
        # A stranger's bytes before HELLO: an OPEN, then a frame too large to be a HELLO. Both are hung up
        # on, the second without its body being read.
        for frame in (struct.pack("!I", 3) + b"\x93\x03\x01", struct.pack("!I", 1 << 30)):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(frame)
            assert len(await asyncio.wait_for(reader.read(), 5)) < 200      # (a REFUSED frame at most), then EOF
            writer.close()
        # An authenticated peer's malformed frame: hung up on, with nothing served.
        channel = await Channel.connect("127.0.0.1", port, TOKEN, 5.0)
        channel.send((Kind.OPEN, 1, "GET", "no-slash", [], b""))
        await until(lambda: channel.closed, timeout=2.0)
        assert channel.closed and not server.connections
        with pytest.raises(ChannelRefused, match="version"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            payload = msgspec.msgpack.encode([0, VERSION + 1, TOKEN])
            writer.write(struct.pack("!I", len(payload)) + payload)
            raise ChannelRefused(msgspec.msgpack.decode((await reader.read())[4:])[1])
        server.close()
    run(main())


def test_a_slow_leg_holds_back_only_itself_and_loses_nothing():
    async def main():
        app = app_under_test()
        server, port = await served(app)
        channel = await Channel.connect("127.0.0.1", port, TOKEN, 5.0)
        slow = await channel.open("GET", "/stream?chunks=128", [], b"", None)      # 8 MiB, unread for now
        for _ in range(3):
            quick = await channel.open("POST", "/echo", [], b"{}", None)
            assert msgspec.json.decode(await quick.read())["body"] == {}
        await until(lambda: app.state.sent >= WINDOW)
        await asyncio.sleep(0.2)
        assert WINDOW <= app.state.sent <= WINDOW + CHUNK       # the window, not the whole 8 MiB
        body = await slow.read()
        assert len(body) == 128 * CHUNK and app.state.sent == 128 * CHUNK
        assert all(body[n * CHUNK:(n + 1) * CHUNK] == bytes([n % 251]) * CHUNK for n in range(128))
        channel.close()
        server.close()
    run(main())


def test_closing_a_half_read_leg_or_losing_the_connection_is_seen_by_both_ends():
    async def main():
        app = app_under_test()
        server, port = await served(app)
        channel = await Channel.connect("127.0.0.1", port, TOKEN, 5.0)
        leg = await channel.open("GET", "/stream?chunks=100000", [], b"", None)
        assert len(await leg.leg.next_chunk()) == CHUNK
        leg.close()
        await asyncio.wait_for(app.state.left.wait(), 5)       # the app's stream was cancelled
        assert not channel.legs and not any(c.legs for c in server.connections)
        app.state.left.clear()
        leg = await channel.open("GET", "/stream?chunks=100000", [], b"", None)
        server.close()                                          # the worker goes away mid-answer
        with pytest.raises(Broken, match="channel"):
            await leg.read()
        await asyncio.wait_for(app.state.left.wait(), 5)
        with pytest.raises(Broken):
            await channel.open("POST", "/echo", [], b"{}", None)
    run(main())


def test_upstream_takes_the_channel_a_worker_offers_and_http_when_it_cannot_be_had(caplog):
    async def main():
        app = app_under_test()
        channel_server, port = await served(app)
        listener = socket.create_server(("127.0.0.1", 0))
        http = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        http.install_signal_handlers = lambda: None
        serving = asyncio.ensure_future(http.serve(sockets=[listener]))
        while not http.started:
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        sent = Counter("legs", "", ["transport"], registry=CollectorRegistry())
        upstream = Upstream(5.0, control_headers(SECRET), TOKEN, sent=sent)

        async def echo() -> dict:
            status, body = await upstream.call("POST", url + "/echo", {"x": 1})
            assert status == 200 and body["body"] == {"x": 1}
            return {t: sent.labels(t)._value.get() for t in ("channel", "http")}

        async def connected(upstream: Upstream) -> None:        # (offer connects in the background)
            await asyncio.wait({upstream.channels[url]})

        assert await echo() == {"channel": 0, "http": 1}            # nothing offered yet
        upstream.offer(url, port)
        await connected(upstream)
        assert await echo() == {"channel": 1, "http": 1}
        assert await echo() == {"channel": 2, "http": 1} and len(channel_server.connections) == 1   # one, kept
        dead = socket.create_server(("127.0.0.1", 0))
        dead_port = dead.getsockname()[1]
        dead.close()
        with caplog.at_level(logging.DEBUG, logger="kvhandoff.router"):
            upstream.offer(url, dead_port)                          # a stale port: HTTP, and a warning
            await connected(upstream)
            assert await echo() == {"channel": 2, "http": 2}
            assert await echo() == {"channel": 2, "http": 3}        # (not tried again at once)
        failures = [r for r in caplog.records if "its channel" in r.getMessage()]
        assert len(failures) == 1 and failures[0].levelno == logging.WARNING
        assert f"(port {dead_port}) failed" in failures[0].getMessage()
        await until(lambda: not channel_server.connections)
        assert not channel_server.connections                        # the replaced channel was closed
        upstream.offer(url, port)                                    # it is back: the channel again
        await connected(upstream)
        assert await echo() == {"channel": 3, "http": 3}
        wrong = Upstream(5.0, control_headers(SECRET), control_token(b"another deployment"), sent=sent)
        wrong.offer(url, port)
        await asyncio.wait({wrong.channels[url]})
        status, _ = await wrong.call("POST", url + "/echo", {"x": 1})      # refused: HTTP
        assert status == 200 and sent.labels("http")._value.get() == 4
        await wrong.close()
        await upstream.close()
        http.should_exit = True
        await serving
        channel_server.close()
    run(main())


def test_the_channel_bench_times_both_transports_with_the_routers_own_upstream():
    """`python -m kvhandoff.bench.channel`: a real worker-like server (serve_forever, uvicorn and the
    channel) in its own process, the router's Upstream timing legs both ways."""
    import re
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "kvhandoff.bench.channel", "--legs", "40", "--warmup", "5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = dict(re.findall(r"^(http|channel) +([\d.]+) ", out.stdout, re.M))
    assert set(rows) == {"http", "channel"} and all(float(v) > 0 for v in rows.values()), out.stdout
    assert re.search(r"channel / http p50: [\d.]+ \(", out.stdout), out.stdout
