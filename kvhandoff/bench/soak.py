"""Soak: mixed load against a local stack for a long while, watching for drift (issue 7), optionally
while killing its workers (chaos, issue 26). A short chaos run is in CI (tests/test_soak.py).

    python -m kvhandoff.bench.soak --minutes 10 --mode push --out soak-out
    python -m kvhandoff.bench.soak --minutes 10 --kill-every-s 15 --out chaos-out     # 2 prefill + 2 decode

It starts `kvhandoff up` (tiny model by default, bidirectional so sessions retain KV), then keeps
`--concurrency` clients busy with a mix: streamed completions, non-streamed chat, multi-turn sessions,
clients that hang up mid-stream, and bad requests (malformed JSON, impossible lengths). Every
`--sample-s` it records each process's RSS and every worker's pool occupancy. At the end it waits for
the stack to drain and retained KV to expire, checks that every pool is back at baseline, and sends
one more request, which must be served.

What it reports (stdout and OUT/soak.json): requests by outcome (anything unexpected is a finding:
a 5xx, a stream error, a transport error, or a bad request that was not answered with a 4xx), RSS per
process at the first sample after warm-up and at the end (the drift) and its high-water mark
(VmHWM), peak pool use, and the pools
after the drain. Exit status 1 if any unexpected outcome or leak was seen.

Streamed completions draw from a fixed set of prompts (greedy, exactly `max_tokens` each). One that
ends without an error but short of its tokens is `unexpected_short`. Where every worker is
batch-invariant (its /health says `batch_invariant`: fp32 on the compiled kernels, and bf16 where the
CPU has bf16 dot products), the first answer to each prompt is its reference and a later one that
differs is `unexpected_wrong_tokens`; elsewhere a greedy answer can change with what shares its steps,
so answers are not compared.

Chaos (`--kill-every-s S`): every S seconds a random worker is SIGKILLed, chosen among the healthy ones
whose role has another healthy worker (a kill never leaves a role empty; a tick with no such worker is
skipped and counted), and `kvhandoff up` restarts it. A request the kill hits must end as a clear error
(an HTTP error status or an error event, counted `failed_clearly`) or be served elsewhere (retried or
migrated: counted `ok`, and `rescued` by how); a transport error, a short stream or wrong tokens stay
unexpected. For each kill: how long until the router's /health found a new process answering at that
worker's URL (the supervisor's restart backoff, 1 s doubling up to 30 s for a worker that keeps dying,
is part of it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import httpx

from kvhandoff.bench.client import chat_body, completion_body, open_session, random_text, stream_completion
from kvhandoff.bench.meta import git_commit, log
from kvhandoff.bench.stack import Stack, rss_kib, stop_on_signal
from kvhandoff.wire.modes import NAMES, Mode

KINDS = ("stream", "chat", "session", "hangup", "bad")
WEIGHTS = (5, 2, 2, 1, 1)
RETENTION_TTL_S = 20        # short, so retained KV expires within the drain
NUM_PROMPTS = 48            # the streamed completions' fixed prompts (each answer checked against the first)


def command_lines(stack: Stack) -> dict[int, list[str]]:
    """pid -> its command line's words, for the processes under `kvhandoff up` (one gone meanwhile is left out)."""
    lines = {}
    for pid in stack.pids():
        try:
            lines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
    return lines


def worker_pids(stack: Stack) -> dict[str, int]:
    """A worker's URL (the port on its command line; workers bind loopback) -> the pid serving it now."""
    return {f"http://127.0.0.1:{words[words.index('--port') + 1]}": pid for pid, words in command_lines(stack).items()
            if "serve" in words and "--role" in words[:-1] and "--port" in words[:-1]}


def process_names(stack: Stack) -> dict[int, str]:
    """pid -> role (a worker's with its port, which a restart keeps), from the command lines under
    `kvhandoff up`."""
    names = {}
    for pid, words in command_lines(stack).items():
        if "router" in words:
            names[pid] = "router"
        elif "--role" in words:
            port = words[words.index("--port") + 1] if "--port" in words[:-1] else str(pid)
            names[pid] = f"{words[words.index('--role') + 1]}-{port}"
        elif "up" in words:
            names[pid] = "up"
    return names


def at_baseline(worker: dict) -> bool:
    """A worker's pool (its /health, or the drain report's subset of it) is all free again."""
    return ("num_blocks" in worker and worker.get("num_free_blocks") == worker["num_blocks"]
            and not worker.get("num_pinned_handoffs")
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
        self.prompts = [(random_text(self.rng, self.rng.randint(8, 400)), self.rng.randint(4, 48))
                        for _ in range(NUM_PROMPTS)]
        self.answers: dict[int, str] = {}        # prompt index -> the first full answer seen
        self.kills: list[dict] = []
        self.kills_skipped = 0
        self.rescued: Counter[str] = Counter()   # requests served though a worker failed them: by how
        self.serving_at_end = ""                 # a request after the drain: "ok", or what went wrong
        self.check_tokens = False                # answers compared only where the engine is batch-invariant

    def note(self, outcome: str, detail: str | None = None) -> None:
        self.outcomes[outcome] += 1
        if outcome.startswith("unexpected") and len(self.unexpected) < 50:
            self.unexpected.append(f"{outcome}: {detail}")

    async def one(self, client: httpx.AsyncClient, kind: str) -> None:
        rng = self.rng
        if kind == "stream":
            index = rng.randrange(NUM_PROMPTS)
            prompt, max_tokens = self.prompts[index]
            result = await stream_completion(self.streams, self.url, completion_body(self.model, prompt, max_tokens))
            if self.judge(result.error, result.handoff):
                self.check_answer(index, max_tokens, result)
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
        elif self.args.kill_every_s and r.status_code in (502, 503):     # no worker left to validate it
            self.note("failed_clearly", f"HTTP {r.status_code}: {r.text[:200]}")
        else:
            self.note("unexpected_bad_request_answer", f"HTTP {r.status_code}: {r.text[:200]}")

    def judge(self, error: str | None, handoff: dict | None = None) -> bool:
        if error is None:
            self.note("ok")
            for how in ("retried_elsewhere", "migrated"):
                if handoff and handoff.get(how):
                    self.rescued[how] += 1
            return True
        if error.startswith(("HTTP 429", "HTTP 503")):
            self.note("refused_busy")
        elif self.args.kill_every_s and error.startswith(("HTTP 5", "stream error: ")):
            self.note("failed_clearly", error)      # what a kill may do to a request it hits: say so
        else:
            self.note("unexpected_error", error)
        return False

    def check_answer(self, index: int, max_tokens: int, result) -> None:
        how = {k: v for k, v in (result.handoff or {}).items() if k in ("kv_source", "retried_elsewhere", "migrated",
                                                                          "reused_tokens") and v}
        if result.output_tokens != max_tokens:
            self.note("unexpected_short",
                      f"prompt {index}: {result.output_tokens} of {max_tokens} tokens, no error; {how}")
        elif self.check_tokens and self.answers.setdefault(index, result.text) != result.text:
            self.note("unexpected_wrong_tokens", f"prompt {index}: {result.text[:80]!r} where "
                      f"{self.answers[index][:80]!r} came before; {how}")

    async def chaos(self, client: httpx.AsyncClient, until: float, started: float) -> None:
        """Every --kill-every-s: SIGKILL a random worker whose role keeps another healthy one."""
        rng = random.Random(self.args.seed + 1)     # the clients' draws do not change who is killed when
        recoveries = []
        while True:
            await asyncio.sleep(self.args.kill_every_s)
            if time.monotonic() >= until:
                break
            try:
                workers = await self.workers(client)
            except httpx.HTTPError as e:
                self.note("unexpected_transport_error", f"router /health: {type(e).__name__}: {e}")
                continue
            healthy = [w for w in workers if w.get("status") == "ok"]
            eligible = [w for w in healthy if sum(h["role"] == w["role"] for h in healthy) >= 2]
            pids = worker_pids(self.stack)
            eligible = [w for w in eligible if w["url"] in pids]
            if not eligible:
                self.kills_skipped += 1
                continue
            victim = rng.choice(eligible)
            pid = pids[victim["url"]]
            os.kill(pid, signal.SIGKILL)
            kill = {"at_s": round(time.monotonic() - started, 1), "role": victim["role"], "url": victim["url"],
                    "pid": pid, "recovered_s": None}
            self.kills.append(kill)
            log(f"chaos: killed {victim['role']} {victim['url']} (pid {pid}) at t={kill['at_s']:.0f}s")
            recoveries.append(asyncio.create_task(self.recovery(client, kill, time.monotonic())))
        await asyncio.gather(*recoveries)

    async def recovery(self, client: httpx.AsyncClient, kill: dict, killed_at: float) -> None:
        """Until another process answers at the killed worker's URL, as the router sees it (bounded)."""
        deadline = killed_at + 120.0
        while time.monotonic() < deadline:
            try:
                workers = await self.workers(client)
            except httpx.HTTPError:
                workers = []            # the client loops count the router's failures; keep looking
            if any(w["url"] == kill["url"] and w.get("status") == "ok" for w in workers) \
                    and worker_pids(self.stack).get(kill["url"], kill["pid"]) != kill["pid"]:
                kill["recovered_s"] = round(time.monotonic() - killed_at, 2)
                return
            await asyncio.sleep(0.1)

    async def workers(self, client: httpx.AsyncClient) -> list[dict]:
        """The router's /health report of every worker (httpx.HTTPError if the router does not answer)."""
        return (await client.get(self.url + "/health")).json().get("workers", [])

    async def batch_invariance(self, client: httpx.AsyncClient, wait_s: float = 30.0) -> set[bool | None]:
        """Every worker's `batch_invariant`, once each has answered a health check: on a loaded machine one
        may miss the router's check (its report then says nothing), which must not turn the comparison off."""
        give_up = time.monotonic() + wait_s
        while True:
            invariant = {w.get("batch_invariant") for w in await self.workers(client)}
            if None not in invariant or time.monotonic() >= give_up:
                return invariant
            await asyncio.sleep(0.5)

    async def client_loop(self, client: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            kind = self.rng.choices(KINDS, WEIGHTS)[0]
            try:
                await self.one(client, kind)
            except httpx.HTTPError as e:
                self.note("unexpected_transport_error", f"{kind}: {type(e).__name__}: {e}")

    async def sampler(self, client: httpx.AsyncClient, until: float, started: float) -> None:
        while True:
            names = process_names(self.stack)      # again each time: a killed worker comes back as another pid
            workers = await self.workers(client)
            pools = {w["url"]: {"role": w.get("role"), "used": w["num_blocks"] - w["num_free_blocks"],
                                "retained": w.get("num_retained_blocks", 0), "total": w["num_blocks"]}
                     for w in workers if "num_blocks" in w}     # not one being restarted
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
            invariant = await self.batch_invariance(client)
            self.check_tokens = invariant == {True}
            if not self.check_tokens:
                log(f"soak: batch-invariant workers: {sorted(map(str, invariant))} (/health): a greedy answer may "
                    "change with what shares its steps, so answers are not compared with each other")
            chaos = [self.chaos(client, until, started)] if self.args.kill_every_s else []
            await asyncio.gather(self.sampler(client, until, started), *chaos,
                                 *(self.client_loop(client, until) for _ in range(self.args.concurrency)))
            drained = await self.drain(client)
            prompt, max_tokens = self.prompts[0]
            last = await stream_completion(self.streams, self.url, completion_body(self.model, prompt, max_tokens))
            self.serving_at_end = last.error or ("ok" if last.output_tokens == max_tokens else "short")
        return self.report(drained)

    async def drain(self, client: httpx.AsyncClient) -> dict:
        """Wait (up to the retention TTL and a margin) for every pool to be free again."""
        deadline = time.monotonic() + self.args.retention_ttl * 2 + 30
        while True:
            workers = await self.workers(client)
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
        recovered = [k["recovered_s"] for k in self.kills if k["recovered_s"] is not None]
        chaos = {"kill_every_s": self.args.kill_every_s, "kills": self.kills, "skipped": self.kills_skipped,
                 "not_recovered": [k for k in self.kills if k["recovered_s"] is None],
                 "worst_recovery_s": max(recovered, default=None),
                 "median_recovery_s": sorted(recovered)[len(recovered) // 2] if recovered else None,
                 "rescued": dict(self.rescued)}
        return {"minutes": self.args.minutes, "mode": self.args.mode, "model": self.args.model,
                "prefill": self.args.prefill, "decode": self.args.decode, "chaos": chaos,
                "concurrency": self.args.concurrency, "git_commit": git_commit(), "outcomes": dict(self.outcomes),
                "unexpected": self.unexpected, "rss": rss, "peak_blocks_used": peak, "after_drain": drained,
                "leaks": leaks, "tokens_checked": self.check_tokens, "serving_at_end": self.serving_at_end,
                "samples": self.samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--mode", default=Mode.PUSH.value, choices=NAMES)
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=15.0)
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS drift is measured from the first sample after this")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--dtype", default="auto", help="the workers' --dtype; answers are compared with each other where "
                   "every worker is batch-invariant (/health; default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-every-s", type=float, default=0.0,
                   help="chaos: SIGKILL a random worker this often (never the last healthy one of its role); 0: never")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (default: 2 with --kill-every-s, else 1)")
    p.add_argument("--decode", type=int, default=None, help="decode workers (default: 2 with --kill-every-s, else 1)")
    p.add_argument("--retention-ttl", type=float, default=RETENTION_TTL_S,
                   help="seconds retained KV lives (short, so it expires within the drain; default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("soak-out"))
    args = p.parse_args(argv)
    if args.kill_every_s < 0:
        p.error("--kill-every-s must be >= 0")
    args.prefill = args.prefill or (2 if args.kill_every_s else 1)
    args.decode = args.decode or (2 if args.kill_every_s else 1)
    args.out.mkdir(parents=True, exist_ok=True)
    # Under chaos a worker may die far more often than a crash loop's 5 in 300 s: never give one up.
    restarts = ["--max-restarts", "1000000"] if args.kill_every_s else []
    stack = Stack(f"soak-{args.mode}", args.mode, "0,1",
                  ["--model", args.model, "--num-blocks", str(args.num_blocks), "--dtype", args.dtype,
                   "--bidirectional", "--retention-ttl", f"{args.retention_ttl:g}", "--prefill", str(args.prefill),
                   "--decode", str(args.decode), *restarts], args.out / "stack.log")
    stop_on_signal(lambda: [stack])
    log(f"soak: starting a {args.mode} stack ({args.model}, {args.prefill} prefill + {args.decode} decode); "
        f"{args.minutes:g} min at concurrency {args.concurrency}"
        + (f", a worker killed every {args.kill_every_s:g} s" if args.kill_every_s else ""))
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
    if args.kill_every_s:
        c = result["chaos"]
        log(f"chaos: {len(c['kills'])} kills ({sum(k['role'] == 'prefill' for k in c['kills'])} prefill), "
            f"{c['skipped']} ticks skipped (no role had a second healthy worker); recovery median "
            f"{c['median_recovery_s']} s, worst {c['worst_recovery_s']} s; not recovered: {len(c['not_recovered'])}; "
            f"served despite a failed worker: {c['rescued']}")
    log(f"after drain: {result['after_drain']}")
    for line in result["unexpected"][:10]:
        log(f"UNEXPECTED {line}")
    failed = bool(result["unexpected"] or result["leaks"] or result["chaos"]["not_recovered"]
                  or result["serving_at_end"] != "ok")
    log(f"soak {'FAILED' if failed else 'passed'}: {len(result['unexpected'])} unexpected outcomes, "
        f"leaks on {result['leaks'] or 'no worker'}, a request after the drain: {result['serving_at_end']}; "
        f"details in {args.out / 'soak.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
