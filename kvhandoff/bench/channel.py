"""A router-worker leg over HTTP against over the worker's persistent channel (issue 46), alone.

`python -m kvhandoff.bench.channel` serves a FastAPI app with `wire.http.serve_forever` (uvicorn and
the channel, as a worker serves) in a process on one core, and from another core sends it legs with
the router's own `Upstream`, alternating: HTTP, then the channel. A leg is what a pull prefill leg
is on a first token's path: a ~1 KB JSON body, answered with one JSON line read as it arrives (then
the answer's end). Prints p50 and p90 of each and the ratio; the router's CPU per leg (this client
process's, schedstat) for each.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

from kvhandoff.bench.meta import log

SECRET = b"bench-channel-secret"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 180}], "max_tokens": 16,
        "kv_transfer_params": {"handoff_id": "a" * 32, "role": "prefill", "mode": "pull", "created": 1}}


def serve(port: int) -> None:
    """The worker's side: an answer like a prefill's (a first line, then its end)."""
    import msgspec
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    from kvhandoff.wire.http import serve_forever

    app = FastAPI()

    @app.post("/leg")
    async def leg(request: Request):
        body = msgspec.json.decode(await request.body())

        async def lines():
            yield msgspec.json.encode({"first_token": {"token_id": len(body)}}) + b"\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/health")
    async def health():
        return {"status": "ok", "channel_port": app.state.channel_port}

    serve_forever(app, "127.0.0.1", port, log_level="warning", channel_secret=SECRET)


async def measure(url: str, legs: int, warmup: int) -> dict:
    import aiohttp

    from kvhandoff.router.upstream import Upstream
    from kvhandoff.wire.auth import control_headers, control_token

    for _ in range(300):
        try:
            async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
                health = await resp.json()
                if health.get("channel_port"):
                    break
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    http = Upstream(5.0, control_headers(SECRET))
    channel = Upstream(5.0, control_headers(SECRET), control_token(SECRET))
    channel.offer(url, health["channel_port"])
    await asyncio.wait({channel.channels[url]})

    async def once(upstream: Upstream) -> tuple[float, float]:
        started, cpu = time.perf_counter(), time.thread_time()
        answer = await upstream.open("POST", url + "/leg", BODY)
        async for _ in answer.lines():
            first = time.perf_counter() - started
            break
        await answer.read()
        answer.close()
        return first, time.thread_time() - cpu

    for _ in range(warmup):
        await once(http)
        await once(channel)
    times: dict[str, list[tuple[float, float]]] = {"http": [], "channel": []}
    for n in range(legs):
        for name, upstream in (("http", http), ("channel", channel)) if n % 2 else (("channel", channel), ("http", http)):
            times[name].append(await once(upstream))
    await http.close()
    await channel.close()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvhandoff.bench.channel", description=__doc__.splitlines()[0])
    p.add_argument("--legs", type=int, default=3000, help="legs each way, alternated (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=300, help="(default: %(default)s)")
    p.add_argument("--port", type=int, default=0, help="the server's HTTP port (default: a free one)")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    import socket
    port = args.port or socket.create_server(("127.0.0.1", 0)).getsockname()[1]
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = cores[0], cores[-1]
    server = subprocess.Popen(["taskset", "-c", str(server_core), sys.executable, "-m", "kvhandoff.bench.channel",
                               "--serve", str(port)])
    try:
        os.sched_setaffinity(0, {client_core})
        log(f"server on core {server_core}, client (the router's Upstream) on core {client_core}; "
            f"{args.legs} legs each way, alternated")
        times = asyncio.run(measure(f"http://127.0.0.1:{port}", args.legs, args.warmup))
    finally:
        server.terminate()
        server.wait(10)
    print(f"\nA leg's first line (a ~1 KB JSON body, one line back), {args.legs} each way, load {os.getloadavg()[0]:.2f}")
    print(f"{'transport':<10}{'p50 ms':>9}{'p90 ms':>9}{'client CPU us/leg':>19}")
    p50 = {}
    for name, samples in times.items():
        firsts = sorted(first for first, _ in samples)
        p50[name] = statistics.median(firsts)
        cpu = statistics.mean(c for _, c in samples)
        print(f"{name:<10}{p50[name] * 1e3:>9.3f}{firsts[int(0.9 * len(firsts))] * 1e3:>9.3f}{cpu * 1e6:>19.0f}")
    print(f"channel / http p50: {p50['channel'] / p50['http']:.2f} ({(p50['http'] - p50['channel']) * 1e3:.3f} ms less a leg)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
