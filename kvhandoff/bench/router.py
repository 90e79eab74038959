"""The router alone: its CPU per request, the rate one core of it serves, the latency it adds.

`python -m kvhandoff.bench.router` puts a real `kvhandoff router` (its own process, pinned to one core;
or `--routers N` of them on one front port, router i on core i) in front of workers that answer at once (kvhandoff.bench.instant: the wire contract without an
engine, on the other cores with this client), so that a change to the router is judged without the
engine's noise. Per mode, streamed requests (a prompt of about --prompt-words words, --tokens tokens
out):
- latency: one request at a time, the client's TTFT and end-to-end time through the router, against
  the same answer streamed by an instant worker directly (what the router adds, p50 and p99);
- load: --concurrency requests in flight until --requests are done: requests a second, and the
  router's CPU time per request (from /proc: user + system), which does not depend on whether its
  core was saturated; 1000 / that is the rate one router core could serve.
It talks HTTP only (aiohttp client, kept-alive connections).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvhandoff.bench.meta import log
from kvhandoff.launch.lifeline import child_env
from kvhandoff.launch.supervisor import free_port

SECRET = "router-bench-secret"
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    mode: str
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    direct_ttft_p50: float
    direct_ttft_p99: float
    cpu_ms_per_request: float
    requests_per_s: float
    failed: int
    worker_calls: dict[str, float]          # requests the workers served per client request, by role and path

    @property
    def added_p50(self) -> float:
        return self.ttft_p50 - self.direct_ttft_p50

    @property
    def added_p99(self) -> float:
        return self.ttft_p99 - self.direct_ttft_p99


async def served(urls: dict[str, str]) -> dict[str, int]:
    """What the instant workers have served so far, by role and path."""
    counts = {}
    async with aiohttp.ClientSession() as session:
        for role in ("prefill", "decode"):
            async with session.get(urls[role] + "/health") as r:
                counts |= {f"{role} {path}": n for path, n in (await r.json())["served"].items()}
    return counts


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def spawn(args: list[str], cores: set[int] | None, log_path: Path) -> subprocess.Popen:
    out = open(log_path, "wb")
    env = child_env(dict(os.environ)) | {"KVHANDOFF_SECRET": SECRET, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)


async def wait_up(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up within {timeout:.0f} s")
            await asyncio.sleep(0.1)


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float]:
    """(TTFT, end to end) in ms of one streamed completion."""
    started = time.perf_counter()
    ttft = None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {(await r.read())[:200]!r}")
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {") and b'"text":"' in line and b'"text":""' not in line:
                ttft = time.perf_counter() - started
            if b'"error"' in line and line.startswith(b"data: {") and "error" in json.loads(line[6:]):
                raise RuntimeError(line[:200].decode(errors="replace"))
    return ttft * 1e3, (time.perf_counter() - started) * 1e3


async def latencies(url: str, body: dict, n: int) -> tuple[list[float], list[float]]:
    async with aiohttp.ClientSession() as session:
        results = [await one(session, url, body) for _ in range(n)]
    return [t for t, _ in results], [e for _, e in results]


async def load(url: str, body: dict, n: int, concurrency: int) -> tuple[float, int]:
    """(seconds, failures) for n requests, `concurrency` at a time."""
    remaining, failed = n, 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, failed
        while remaining > 0:
            remaining -= 1
            try:
                await one(session, url, body)
            except (RuntimeError, aiohttp.ClientError):
                failed += 1

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return time.perf_counter() - started, failed


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench_mode(mode: str, args, out: Path) -> Result:
    cores = sorted(os.sched_getaffinity(0))
    rest = set(cores[1:]) if len(cores) > 1 else None
    if rest:
        os.sched_setaffinity(0, rest)           # this client beside the instant workers, off the router's core
    ports = {role: free_port() for role in ("prefill", "decode", "router")}
    own_ports = [free_port() for _ in range(args.routers)] if args.routers > 1 else [ports["router"]]
    procs = [spawn(["kvhandoff.bench.instant", "--role", role, "--port", str(ports[role])], rest,
                   out / f"instant-{role}-{mode}.log") for role in ("prefill", "decode")]
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    try:
        for role in ("prefill", "decode"):
            await wait_up(urls[role])
        # Several routers: on the shared front port (SO_REUSEPORT), router i on core i (the first shares
        # nothing; the others share their cores with the client and the instant workers).
        routers = []
        for i, port in enumerate(own_ports):
            shared = ["--front-port", str(ports["router"])] if args.routers > 1 else []
            on = {cores[i % len(cores)]} if len(cores) > 1 else None
            routers.append(spawn(["kvhandoff.cli", "router", "--prefill", urls["prefill"], "--decode", urls["decode"],
                                  "--mode", mode, "--port", str(port), *shared, "--log-level", "warning"], on,
                                 out / f"router-{mode}-{i}.log"))
        procs += routers
        for port in own_ports:
            await wait_up(f"http://127.0.0.1:{port}")
        await wait_up(urls["router"])
        body = {"prompt": " ".join(["word"] * args.prompt_words), "max_tokens": args.tokens, "temperature": 0,
                "stream": True}
        await load(urls["router"], body, 200, args.concurrency)                        # warm-up
        ttft, e2e = await latencies(urls["router"], body, args.latency_requests)
        direct, _ = await latencies(urls["decode"], body, args.latency_requests)
        cpu_before, served_before = sum(cpu_seconds(r.pid) for r in routers), await served(urls)
        seconds, failed = await load(urls["router"], body, args.requests, args.concurrency)
        cpu = sum(cpu_seconds(r.pid) for r in routers) - cpu_before
        calls = {k: round((n - served_before.get(k, 0)) / args.requests, 3) for k, n in (await served(urls)).items()}
        return Result(mode, statistics.median(ttft), pct(ttft, 0.99), statistics.median(e2e), statistics.median(direct),
                      pct(direct, 0.99), cpu * 1e3 / args.requests, args.requests / seconds, failed,
                      {k: v for k, v in calls.items() if v})
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvhandoff.bench.router", description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="pull,push", help="handoff modes to route (default: %(default)s)")
    p.add_argument("--requests", type=int, default=2000, help="requests of the load run (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight in the load run (default: %(default)s)")
    p.add_argument("--latency-requests", type=int, default=300, help="sequential requests (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer (default: %(default)s)")
    p.add_argument("--prompt-words", type=int, default=64, help="words of prompt (default: %(default)s)")
    p.add_argument("--routers", type=int, default=1,
                   help="routers on one front port (SO_REUSEPORT; the kernel spreads the client's connections), "
                        "router i pinned to core i (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("router-bench"), help="logs and results.json (default: %(default)s)")
    args = p.parse_args(argv)
    if args.routers < 1:
        p.error("--routers must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        log(f"{mode}: router in front of instant workers ({args.requests} requests, {args.concurrency} in flight)")
        results.append(asyncio.run(bench_mode(mode, args, args.out)))
    where = ("router on one core, instant workers and client on the others" if args.routers == 1 else
             f"{args.routers} routers on one front port, router i on core i, instant workers and client on all but "
             "the first; CPU ms/req: all routers'")
    print(f"\nThe router alone ({args.prompt_words}-word prompts, {args.tokens} tokens out, streamed; {where}; "
          f"load {os.getloadavg()[0]:.2f})")
    print(f"{'mode':<15}{'CPU ms/req':>11}{'1 core req/s':>13}{'req/s':>8}{'TTFT p50':>10}{'p99':>8}"
          f"{'direct p50':>11}{'added p50':>10}{'p99':>8}{'failed':>7}")
    for r in results:
        print(f"{r.mode:<15}{r.cpu_ms_per_request:>11.2f}{1000 / r.cpu_ms_per_request:>13.0f}{r.requests_per_s:>8.0f}"
              f"{r.ttft_p50:>10.2f}{r.ttft_p99:>8.2f}{r.direct_ttft_p50:>11.2f}{r.added_p50:>10.2f}{r.added_p99:>8.2f}"
              f"{r.failed:>7}")
    for r in results:
        print(f"  {r.mode}: worker requests per client request: "
              + ", ".join(f"{k} {v:g}" for k, v in sorted(r.worker_calls.items())))
    (args.out / "results.json").write_text(json.dumps([r.__dict__ | {"added_p50": r.added_p50, "added_p99": r.added_p99}
                                                       for r in results], indent=1))
    return 0 if not any(r.failed for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
