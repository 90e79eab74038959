"""Load (issue 7): 200 concurrent streaming requests on a 1-prefill/1-decode tiny stack, twice. Every
request is a complete stream (200 is below the default --max-in-flight of 256: nothing may be shed),
no block leaks, and the router's memory does not grow from one wave to the next."""
from __future__ import annotations

import asyncio
import json

import httpx

from kvhandoff.bench.stack import rss_kib
from test_router import (
    child_pids,
    router_idle,
    start_up,
    wait_pools_at_baseline,
    wait_until,
)

CONCURRENCY = 200
MAX_TOKENS = 8


async def one(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, int, bool]:
    """(status, tokens streamed, saw [DONE]) of one streamed request."""
    body = {"prompt": f"request {i} alpha bravo charlie", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens, done = 0, False
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, 0, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return 200, tokens, done


async def wave(url: str) -> list[tuple[int, int, bool]]:
    limits = httpx.Limits(max_connections=CONCURRENCY + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        return await asyncio.gather(*(one(client, url, i) for i in range(CONCURRENCY)))


def test_two_waves_of_200_streams(tmp_path):
    # A decode request that gives up on its KV (watchdog, failed registration) sets its blocks aside
    # until 2 x --kv-timeout-s, by design; 10 s keeps that inside the 30 s the test waits for baseline.
    up = start_up(tmp_path, "push", "--max-num-seqs", "32", "--kv-timeout-s", "10")
    try:
        router = child_pids(up)["router"]
        sizes = []
        for _ in range(2):
            results = asyncio.run(wave(up.url))
            incomplete = [(i, result) for i, result in enumerate(results) if result != (200, MAX_TOKENS, True)]
            assert not incomplete, f"{len(incomplete)} of {CONCURRENCY} streams incomplete: {incomplete[:5]}"
            wait_pools_at_baseline(up.url, timeout=30)
            wait_until(lambda: router_idle(up.url), "the router still counts requests in flight", timeout=15)
            sizes.append(rss_kib(router))
            print(f"wave: {CONCURRENCY} complete streams; router RSS {sizes[-1]} KiB")
        # The first wave warms the router up (connection pools, imports); the second must not add to it.
        assert sizes[1] - sizes[0] < 20 * 1024, f"router RSS grew {sizes[1] - sizes[0]} KiB over a wave"
    finally:
        assert up.stop() == 0, up.text()[-3000:]
