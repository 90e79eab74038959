"""The router alone: its CPU per request, the rate one core of it serves, the latency it adds.

`python -m kvhandoff.bench.router` puts a real `kvhandoff router` (its own process, pinned to one core;
or `--routers N` of them on one front port, router i on core i) in front of workers that answer at once (kvhandoff.bench.instant: the wire contract without an
engine, on the other cores with this client), so that a change to the router is judged without the
engine's noise. Per mode, streamed requests (a prompt of about --prompt-words words, --tokens tokens
out):
- latency: one request at a time, the client's TTFT and end-to-end time through the router, against
  the same answer streamed by an instant worker directly (what the router adds, p50 and p99);
- load: --concurrency requests in flight until --requests are done: requests a second, and the
  router's CPU time per request (from /proc: user + system); 1000 / that is the rate one router core
  could serve. (It is lower when the router's core is saturated: one loop turn serves several
  requests' reads and writes. So the latency run's CPU per request, one request at a time, is shown
  too: the same work whatever else limits the load's rate.)
It talks HTTP only (aiohttp client, kept-alive connections).

`--workers N`: the fleet's size, N/2 instant prefill and N/2 instant decode workers (two processes),
each publishing KV events for what it would hold (kvhandoff.bench.instant: an LRU of --capacity
blocks, one retained turn per conversation), routed with `--policy` (cache-aware by default) and
bidirectional reuse with --shared-sessions, so that every decision reads the index and the session
map; the load is conversations (token-id prompts growing by a turn each, over shared system
prompts, `X-Session-Id`). Per N it adds what the index absorbed (events/s), its memory, its lookups'
p50/p99 (us), and a late router's resync time.
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
from kvhandoff.wire.auth import control_headers
from kvhandoff.wire.modes import ROLES

SECRET = "router-bench-secret"
IDLE_S = 3.0                # the router's idle CPU (polls, heartbeats) is read over this long before the load
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
    workers: int = 2
    events_per_s: float = 0.0
    index: dict | None = None               # the router's /admin/kv-index stats after the load
    resync_ms: float | None = None          # a router started after the load: its slowest feed's resync
    blocks_per_s: float = 0.0              # blocks stored or removed a second, in those events
    apply_us_per_event: float | None = None # the router's time decoding and applying live batches, per event
    idle_cpu_ms_per_s: float | None = None  # the router's CPU with no request: health polls, event heartbeats
    cpu_ms_one_at_a_time: float = 0.0       # its CPU per request in the latency run (one request at a time)

    @property
    def added_p50(self) -> float:
        return self.ttft_p50 - self.direct_ttft_p50

    @property
    def added_p99(self) -> float:
        return self.ttft_p99 - self.direct_ttft_p99


async def served(fleet: dict[str, list[str]]) -> dict[str, int]:
    """What the instant workers have served so far, by role and path."""
    counts: dict[str, int] = {}
    async with aiohttp.ClientSession() as session:
        for role, urls in fleet.items():
            for url in urls:
                async with session.get(url + "/health") as r:
                    for path, n in (await r.json())["served"].items():
                        counts[f"{role} {path}"] = counts.get(f"{role} {path}", 0) + n
    return counts


class Conversations:
    """The --workers load: `count` conversations in turn, each prompt its previous one plus a turn of
    TURN_TOKENS new token ids (a new conversation past MAX_TOKENS), over one of SYSTEMS shared system
    prompts; each request names its conversation (X-Session-Id)."""
    TURN_TOKENS, MAX_TOKENS, SYSTEMS, SYSTEM_TOKENS = 64, 1024, 8, 128

    def __init__(self, count: int, tokens_out: int):
        self.prompts: list[list[int]] = [self.system(i) for i in range(count)]
        self.turn, self.tokens_out = 0, tokens_out

    def system(self, i: int) -> list[int]:
        return [(i % self.SYSTEMS) * 1000 + t for t in range(self.SYSTEM_TOKENS)]

    def next(self) -> tuple[dict, dict]:
        self.turn += 1
        i = self.turn % len(self.prompts)
        prompt = self.prompts[i] + [(self.turn * 7 + t) % 50_000 for t in range(self.TURN_TOKENS)]
        self.prompts[i] = prompt if len(prompt) < self.MAX_TOKENS else self.system(i)
        body = {"prompt": prompt, "max_tokens": self.tokens_out, "temperature": 0, "stream": True}
        return body, {"X-Session-Id": f"conversation-{i}"}


def fixed(body: dict):
    return lambda: (body, {})


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


async def one(session: aiohttp.ClientSession, url: str, request) -> tuple[float, float]:
    """(TTFT, end to end) in ms of one streamed completion (`request()`: its body and headers)."""
    body, headers = request()
    started = time.perf_counter()
    ttft = None
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {(await r.read())[:200]!r}")
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {") and b'"text":"' in line and b'"text":""' not in line:
                ttft = time.perf_counter() - started
            if b'"error"' in line and line.startswith(b"data: {") and "error" in json.loads(line[6:]):
                raise RuntimeError(line[:200].decode(errors="replace"))
    return ttft * 1e3, (time.perf_counter() - started) * 1e3


async def latencies(url: str, request, n: int) -> tuple[list[float], list[float]]:
    async with aiohttp.ClientSession() as session:
        results = [await one(session, url, request) for _ in range(n)]
    return [t for t, _ in results], [e for _, e in results]


async def load(url: str, request, n: int, concurrency: int) -> tuple[float, int]:
    """(seconds, failures) for n requests, `concurrency` at a time."""
    remaining, failed = n, 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, failed
        while remaining > 0:
            remaining -= 1
            try:
                await one(session, url, request)
            except (RuntimeError, aiohttp.ClientError):
                failed += 1

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return time.perf_counter() - started, failed


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def admin(url: str, path: str) -> dict:
    async with aiohttp.ClientSession(headers=control_headers(SECRET)) as session:
        async with session.get(url + path) as r:
            return await r.json()


async def synced(url: str, workers: int, timeout: float = 60.0) -> float:
    """Until the router follows every worker's events (fresh feeds); returns its slowest resync (ms)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(url + "/health") as r:
                feeds = (await r.json())["kv_index"]["feeds"]
            if len(feeds) == workers and all(f["fresh"] for f in feeds.values()):
                return max(f["resync_ms"] for f in feeds.values())
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: {sum(f['fresh'] for f in feeds.values())} of {workers} KV-event feeds "
                                   f"fresh after {timeout:.0f} s")
            await asyncio.sleep(0.05)


async def bench_mode(mode: str, args, out: Path) -> Result:
    cores = sorted(args.cores)
    rest = set(cores[1:]) if len(cores) > 1 else None
    if rest:
        os.sched_setaffinity(0, rest)           # this client beside the instant workers, off the router's core
    per_role = max(1, args.workers // 2)
    ports = {role: [free_port() for _ in range(per_role)] for role in ROLES}
    router_port = free_port()
    own_ports = [free_port() for _ in range(args.routers)] if args.routers > 1 else [router_port]
    events = (["--capacity", str(args.capacity)] + (["--no-events"] if args.no_events else [])) if args.workers else []
    procs = [spawn(["kvhandoff.bench.instant", "--role", role, "--ports", ",".join(map(str, ports[role])), *events],
                   rest, out / f"instant-{role}-{mode}-{args.workers}.log") for role in ROLES]
    fleet = {role: [f"http://127.0.0.1:{p}" for p in ports[role]] for role in ports}
    front = f"http://127.0.0.1:{router_port}"
    fleet_flags = ["--prefill-policy", args.policy, "--bidirectional", "--shared-sessions"] if args.workers else []

    def start_router(port: int, i: int, shared: list[str]) -> subprocess.Popen:
        on = {cores[i % len(cores)]} if len(cores) > 1 else None
        return spawn(["kvhandoff.cli", "router", "--prefill", ",".join(fleet["prefill"]), "--decode",
                      ",".join(fleet["decode"]), "--mode", mode, "--port", str(port), *shared, *fleet_flags,
                      "--log-level", "warning"], on, out / f"router-{mode}-{args.workers}-{i}.log")
    try:
        for url in fleet["prefill"] + fleet["decode"]:
            await wait_up(url)
        # Several routers: on the shared front port (SO_REUSEPORT), router i on core i (the first shares
        # nothing; the others share their cores with the client and the instant workers).
        shared = ["--front-port", str(router_port)] if args.routers > 1 else []
        routers = [start_router(port, i, shared) for i, port in enumerate(own_ports)]
        procs += routers
        for port in own_ports:
            await wait_up(f"http://127.0.0.1:{port}")
            if args.workers and not args.no_events:
                await synced(f"http://127.0.0.1:{port}", 2 * per_role)
        await wait_up(front)
        idle_before, idle_started = sum(cpu_seconds(r.pid) for r in routers), time.perf_counter()
        await asyncio.sleep(IDLE_S)
        idle_ms_per_s = (sum(cpu_seconds(r.pid) for r in routers) - idle_before) * 1e3 / (time.perf_counter() - idle_started)
        if args.workers:
            request = Conversations(4 * args.workers, args.tokens).next
        else:
            request = fixed({"prompt": " ".join(["word"] * args.prompt_words), "max_tokens": args.tokens,
                             "temperature": 0, "stream": True})
        await load(front, request, 200, args.concurrency)                        # warm-up
        cpu_before = sum(cpu_seconds(r.pid) for r in routers)
        ttft, e2e = await latencies(front, request, args.latency_requests)
        alone_ms = (sum(cpu_seconds(r.pid) for r in routers) - cpu_before) * 1e3 / args.latency_requests
        direct, _ = await latencies(fleet["decode"][0], request, args.latency_requests)
        indexed = args.workers and not args.no_events
        stats_before = await admin(f"http://127.0.0.1:{own_ports[0]}", "/admin/kv-index") if indexed else {}
        cpu_before, served_before = sum(cpu_seconds(r.pid) for r in routers), await served(fleet)
        seconds, failed = await load(front, request, args.requests, args.concurrency)
        cpu = sum(cpu_seconds(r.pid) for r in routers) - cpu_before
        calls = {k: round((n - served_before.get(k, 0)) / args.requests, 3) for k, n in (await served(fleet)).items()}
        result = Result(mode, statistics.median(ttft), pct(ttft, 0.99), statistics.median(e2e),
                        statistics.median(direct), pct(direct, 0.99), cpu * 1e3 / args.requests,
                        args.requests / seconds, failed, {k: v for k, v in calls.items() if v}, 2 * per_role,
                        idle_cpu_ms_per_s=idle_ms_per_s, cpu_ms_one_at_a_time=alone_ms)
        if indexed:
            stats = await admin(f"http://127.0.0.1:{own_ports[0]}", "/admin/kv-index")
            absorbed = stats["events"] - stats_before["events"]
            result.events_per_s, result.index = absorbed / seconds, stats
            result.blocks_per_s = sum(stats[k] - stats_before[k] for k in ("stored", "removed")) / seconds
            result.apply_us_per_event = (stats["apply_ms"] - stats_before["apply_ms"]) * 1e3 / max(1, absorbed)
            # A router that starts now, beside the fleet as it is: how long until it has the index.
            late_port = free_port()
            late = start_router(late_port, 0, [])
            procs.append(late)
            await wait_up(f"http://127.0.0.1:{late_port}")
            result.resync_ms = await synced(f"http://127.0.0.1:{late_port}", 2 * per_role)
        return result
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
    p.add_argument("--workers", default="0",
                   help="fleet sizes, comma-separated (e.g. 2,8,32,64): instant workers half prefill, half decode, "
                        "publishing KV events, routed --policy with bidirectional reuse (default: one of each, "
                        "no events, one fixed prompt)")
    p.add_argument("--policy", default="cache-aware", choices=["cache-aware", "fewest-in-flight"],
                   help="prefill policy with --workers (default: %(default)s)")
    p.add_argument("--no-events", action="store_true",
                   help="with --workers: the instant workers publish no KV events, so the router asks every one "
                        "on each request's path (/kv/prompt, /kv/retained/find): routing as it was before them")
    p.add_argument("--capacity", type=int, default=512,
                   help="with --workers: prefix-cache blocks each instant worker holds (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("router-bench"), help="logs and results.json (default: %(default)s)")
    args = p.parse_args(argv)
    if args.routers < 1:
        p.error("--routers must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    sizes = [int(n) for n in args.workers.split(",") if n.strip()]
    # The cores this run may use, read once: each point moves this client off the router's core (before
    # this, every point after the first found one core left and ran router, workers and client unpinned).
    args.cores = os.sched_getaffinity(0)
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        for size in sizes:
            args.workers = size
            log(f"{mode}: router in front of {max(2, size)} instant workers ({args.requests} requests, "
                f"{args.concurrency} in flight)")
            results.append(asyncio.run(bench_mode(mode, args, args.out)))
    where = ("router on one core, instant workers and client on the others" if args.routers == 1 else
             f"{args.routers} routers on one front port, router i on core i, instant workers and client on all but "
             "the first; CPU ms/req: all routers'")
    print(f"\nThe router alone ({args.prompt_words}-word prompts, {args.tokens} tokens out, streamed; {where}; "
          f"load {os.getloadavg()[0]:.2f})")
    print(f"{'mode':<15}{'workers':>8}{'alone ms':>9}{'CPU ms/req':>11}{'1 core req/s':>13}{'req/s':>8}{'TTFT p50':>10}{'p99':>8}"
          f"{'direct p50':>11}{'added p50':>10}{'p99':>8}{'failed':>7}")
    for r in results:
        print(f"{r.mode:<15}{r.workers:>8}{r.cpu_ms_one_at_a_time:>9.2f}{r.cpu_ms_per_request:>11.2f}{1000 / r.cpu_ms_per_request:>13.0f}{r.requests_per_s:>8.0f}"
              f"{r.ttft_p50:>10.2f}{r.ttft_p99:>8.2f}{r.direct_ttft_p50:>11.2f}{r.added_p50:>10.2f}{r.added_p99:>8.2f}"
              f"{r.failed:>7}")
    for r in results:
        print(f"  {r.mode}, {r.workers} workers: worker requests per client request: "
              + ", ".join(f"{k} {v:g}" for k, v in sorted(r.worker_calls.items())))
    indexed = [r for r in results if r.index]
    if indexed:
        print(f"\nThe KV-event index (policy {args.policy}, bidirectional, --shared-sessions; {args.capacity} "
              "blocks a worker)")
        print("(events/s: KV events the router absorbed a second during the load, blocks/s: the blocks stored or "
              "removed in them; us/event: its time decoding and applying one; idle: its CPU with no request)")
        print(f"{'mode':<15}{'workers':>8}{'events/s':>9}{'blocks/s':>9}{'us/event':>9}{'idle ms/s':>10}{'blocks':>9}"
              f"{'index MiB':>10}{'lookup p50 us':>14}{'p99 us':>8}{'late resync ms':>15}")
        for r in indexed:
            print(f"{r.mode:<15}{r.workers:>8}{r.events_per_s:>9.0f}{r.blocks_per_s:>9.0f}{r.apply_us_per_event:>9.2f}"
                  f"{r.idle_cpu_ms_per_s:>10.1f}{r.index['blocks']:>9}"
                  f"{r.index['nbytes'] / 2**20:>10.1f}{r.index['lookup_us_p50'] or 0:>14.1f}"
                  f"{r.index['lookup_us_p99'] or 0:>8.1f}{r.resync_ms:>15.1f}")
    (args.out / "results.json").write_text(json.dumps([r.__dict__ | {"added_p50": r.added_p50, "added_p99": r.added_p99}
                                                       for r in results], indent=1))
    return 0 if not any(r.failed for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
