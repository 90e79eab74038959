"""Soak: mixed load against a local stack for a long while, watching for drift (issue 7; not in CI).

    python -m kvhandoff.bench.soak --minutes 10 --mode push --out soak-out

It starts `kvhandoff up` (tiny model by default, bidirectional so sessions retain KV), then keeps
`--concurrency` clients busy with a mix: streamed completions, non-streamed chat, multi-turn sessions,
clients that hang up mid-stream, and bad requests (malformed JSON, impossible lengths). Every
`--sample-s` it records each process's RSS and every worker's pool occupancy. At the end it waits for
the stack to drain and retained KV to expire, then checks that every pool is back at baseline.

What it reports (stdout and OUT/soak.json): requests by outcome (anything unexpected is a finding:
a 5xx, a stream error, a transport error, or a bad request that was not answered with a 4xx), RSS per
process at the first sample after warm-up and at the end (the drift) and its high-water mark
(VmHWM), peak pool use, and the pools
after the drain. Exit status 1 if any unexpected outcome or leak was seen.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import httpx

from kvhandoff.bench.client import chat_body, completion_body, open_session, random_text, stream_completion
from kvhandoff.bench.meta import git_commit, log
from kvhandoff.bench.stack import Stack, stop_on_signal
from kvhandoff.wire.modes import NAMES, Mode

KINDS = ("stream", "chat", "session", "hangup", "bad")
WEIGHTS = (5, 2, 2, 1, 1)
RETENTION_TTL_S = 20        # short, so retained KV expires within the drain


def rss_kib(pid: int, field: str = "VmRSS") -> int | None:
    """A process's resident set now (VmRSS) or its high-water mark (VmHWM), KiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def process_names(stack: Stack) -> dict[int, str]:
    """pid -> role, from the command lines under `kvhandoff up`."""
    names = {}
    for pid in stack.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if "router" in words:
            names[pid] = "router"
        elif "--role" in words:
            names[pid] = f"{words[words.index('--role') + 1]}-{pid}"
        elif "up" in words:
            names[pid] = "up"
    return names


def at_baseline(worker: dict) -> bool:
    """A worker's pool (its /health, or the drain report's subset of it) is all free again."""
    return (worker["num_free_blocks"] == worker["num_blocks"] and not worker.get("num_pinned_handoffs")
            and not worker.get("num_quarantined"))


class Soak:
    def __init__(self, args: argparse.Namespace, stack: Stack):
        self.args, self.stack, self.url = args, stack, stack.url
        self.outcomes: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.samples: list[dict] = []
        self.rng = random.Random(args.seed)
        self.model = ""
        self.streams = None         # bench.client's session, while run() runs

    def note(self, outcome: str, detail: str | None = None) -> None:
        self.outcomes[outcome] += 1
        if outcome.startswith("unexpected") and len(self.unexpected) < 50:
            self.unexpected.append(f"{outcome}: {detail}")

    async def one(self, client: httpx.AsyncClient, kind: str) -> None:
        rng = self.rng
        if kind == "stream":
            result = await stream_completion(self.streams, self.url, completion_body(
                self.model, random_text(rng, rng.randint(8, 400)), rng.randint(4, 48)))
            self.judge(result.error)
        elif kind == "chat":
            body = chat_body(self.model, [{"role": "user", "content": random_text(rng, rng.randint(8, 200))}],
                             rng.randint(4, 32)) | {"stream": False}
            body.pop("stream_options")
            r = await client.post(self.url + "/v1/chat/completions", json=body)
            self.judge(None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}")
        elif kind == "session":
            session, messages = f"soak-{rng.getrandbits(48):x}", []
            for _ in range(rng.randint(2, 4)):
                messages.append({"role": "user", "content": random_text(rng, rng.randint(20, 120))})
                result = await stream_completion(self.streams, self.url, chat_body(self.model, messages, rng.randint(8, 24)),
                                                 headers={"X-Session-Id": session})
                if not self.judge(result.error):
                    return
                messages.append({"role": "assistant", "content": result.text})
        elif kind == "hangup":
            body = completion_body(self.model, random_text(rng, rng.randint(50, 300)), 64)
            async with client.stream("POST", self.url + "/v1/completions", json=body) as resp:
                lines = 0
                async for _ in resp.aiter_lines():
                    lines += 1
                    if lines >= rng.randint(1, 6):
                        break           # the client goes away mid-stream; the stack must free its KV
            self.note("hung_up")
        else:
            await self.bad(client)

    async def bad(self, client: httpx.AsyncClient) -> None:
        rng = self.rng
        choice = rng.randrange(4)
        if choice == 0:
            r = await client.post(self.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens":',
                                  headers={"content-type": "application/json"})
        elif choice == 1:
            r = await client.post(self.url + "/v1/completions", json={"prompt": "x", "max_tokens": -3})
        elif choice == 2:
            r = await client.post(self.url + "/v1/completions",
                                  json={"prompt": random_text(rng, 5000), "max_tokens": 10_000})
        else:
            r = await client.post(self.url + "/v1/chat/completions", json={"messages": "not a list"})
        if 400 <= r.status_code < 500:
            self.note("rejected_4xx")
        else:
            self.note("unexpected_bad_request_answer", f"HTTP {r.status_code}: {r.text[:200]}")

    def judge(self, error: str | None) -> bool:
        if error is None:
            self.note("ok")
            return True
        if error.startswith(("HTTP 429", "HTTP 503")):
            self.note("refused_busy")
        else:
            self.note("unexpected_error", error)
        return False

    async def client_loop(self, client: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            kind = self.rng.choices(KINDS, WEIGHTS)[0]
            try:
                await self.one(client, kind)
            except httpx.HTTPError as e:
                self.note("unexpected_transport_error", f"{kind}: {type(e).__name__}: {e}")

    async def sampler(self, client: httpx.AsyncClient, until: float, started: float) -> None:
        names = process_names(self.stack)
        while True:
            health = (await client.get(self.url + "/health")).json()
            pools = {w["url"]: {"role": w.get("role"), "used": w["num_blocks"] - w["num_free_blocks"],
                                "retained": w.get("num_retained_blocks", 0), "total": w["num_blocks"]}
                     for w in health.get("workers", [])}
            sample = {"t_s": round(time.monotonic() - started, 1), "rss_kib": {n: rss_kib(p) for p, n in names.items()},
                      "hwm_kib": {n: rss_kib(p, "VmHWM") for p, n in names.items()}, "pools": pools, "requests": sum(self.outcomes.values())}
            self.samples.append(sample)
            log(f"t={sample['t_s']:>6.0f}s requests={sample['requests']:>6} "
                + " ".join(f"{n}={(k or 0) / 1024:.0f}MiB" for n, k in sample["rss_kib"].items())
                + " used=" + ",".join(str(p["used"]) for p in pools.values()))
            if time.monotonic() >= until:
                return
            await asyncio.sleep(self.args.sample_s)

    async def run(self) -> dict:
        started = time.monotonic()
        until = started + self.args.minutes * 60
        # Streams go through the benchmarks' client (bench.client); the rest, and the hang-ups, through httpx.
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0)) as client, \
                open_session(120.0) as self.streams:
            self.model = (await client.get(self.url + "/v1/models")).json()["data"][0]["id"]
            await asyncio.gather(self.sampler(client, until, started),
                                 *(self.client_loop(client, until) for _ in range(self.args.concurrency)))
            drained = await self.drain(client)
        return self.report(drained)

    async def drain(self, client: httpx.AsyncClient) -> dict:
        """Wait (up to the retention TTL and a margin) for every pool to be free again."""
        deadline = time.monotonic() + RETENTION_TTL_S * 2 + 30
        while True:
            workers = (await client.get(self.url + "/health")).json()["workers"]
            if all(map(at_baseline, workers)) or time.monotonic() > deadline:
                return {w["url"]: {k: w.get(k) for k in ("role", "num_free_blocks", "num_blocks", "num_pinned_handoffs",
                                                         "num_quarantined", "num_retained_blocks")} for w in workers}
            await asyncio.sleep(1.0)

    def report(self, drained: dict) -> dict:
        warm = next((s for s in self.samples if s["t_s"] >= self.args.warmup_s), self.samples[0])
        last = self.samples[-1]
        half = next(s for s in self.samples if s["t_s"] >= last["t_s"] / 2)
        mib = lambda sample, name: round((sample["rss_kib"].get(name) or 0) / 1024, 1)
        rss = {}
        for name in last["rss_kib"]:
            row = rss[name] = {"warm_mib": mib(warm, name), "half_mib": mib(half, name), "end_mib": mib(last, name),
                               "high_water_mib": round((last["hwm_kib"].get(name) or 0) / 1024, 1)}
            row["drift_mib"] = round(row["end_mib"] - row["warm_mib"], 1)
            row["drift_pct"] = round(100 * row["drift_mib"] / row["warm_mib"], 1) if row["warm_mib"] else None
            # A process that only reaches its allocator's high-water mark grows early and then stops;
            # a leak keeps growing: the second half of the run tells them apart.
            row["second_half_drift_mib"] = round(row["end_mib"] - row["half_mib"], 1)
        peak = {url: max(s["pools"].get(url, {}).get("used", 0) for s in self.samples) for url in drained}
        leaks = [url for url, w in drained.items() if not at_baseline(w)]
        return {"minutes": self.args.minutes, "mode": self.args.mode, "model": self.args.model,
                "concurrency": self.args.concurrency, "git_commit": git_commit(), "outcomes": dict(self.outcomes),
                "unexpected": self.unexpected, "rss": rss, "peak_blocks_used": peak, "after_drain": drained,
                "leaks": leaks, "samples": self.samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--mode", default=Mode.PUSH.value, choices=NAMES)
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=15.0)
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS drift is measured from the first sample after this")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("soak-out"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stack = Stack(f"soak-{args.mode}", args.mode, "0,1",
                  ["--model", args.model, "--num-blocks", str(args.num_blocks), "--bidirectional",
                   "--retention-ttl", str(RETENTION_TTL_S)], args.out / "stack.log")
    stop_on_signal(lambda: [stack])
    log(f"soak: starting a {args.mode} stack ({args.model}); {args.minutes:g} min at concurrency {args.concurrency}")
    stack.start()
    try:
        stack.wait_ready()
        result = asyncio.run(Soak(args, stack).run())
    finally:
        stack.stop()
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    log(f"outcomes: {result['outcomes']}")
    for name, row in result["rss"].items():
        log(f"RSS {name:>16}: {row['warm_mib']:7.1f} MiB after warm-up, {row['half_mib']:7.1f} at half time, "
            f"{row['end_mib']:7.1f} at the end ({row['drift_mib']:+.1f} MiB since warm-up, "
            f"{row['second_half_drift_mib']:+.1f} MiB in the second half); high-water mark {row['high_water_mib']:.1f} MiB")
    log(f"peak blocks used: {result['peak_blocks_used']}")
    log(f"after drain: {result['after_drain']}")
    for line in result["unexpected"][:10]:
        log(f"UNEXPECTED {line}")
    failed = bool(result["unexpected"] or result["leaks"])
    log(f"soak {'FAILED' if failed else 'passed'}: {len(result['unexpected'])} unexpected outcomes, "
        f"leaks on {result['leaks'] or 'no worker'}; details in {args.out / 'soak.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
