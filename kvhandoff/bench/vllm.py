"""`python -m kvhandoff.bench.vllm`: kvhandoff's router against vLLM's own (vllm-router) on the same vLLM
workers, and push against pull, isolated requests (docs/VLLM.md).

Stacks started with `kvhandoff up --engine vllm`, one after the other on this machine's cores: vLLM
colocated on one core (the baseline), a pull pair with both routers in front of the same two workers
(requests alternated between them, one at a time), and a push pair. Every request is a fresh random
prompt of --prompt-len token ids (no prefix cache helps), --new-tokens out exactly (min_tokens,
ignore_eos), greedy, streamed; TTFT is the client's (first chunk with a token), TPOT the mean gap
after it; the second token is the first one the decode worker makes once the KV is there (where push
and pull differ when the first token comes from the prefill's answer). Each router's CPU time per
request is its process's CPU over the requests it served, and that less what it spends idle (health
polls) over as long. The two routers' answers to one prompt are compared: same tokens, or it says so.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvhandoff.bench.meta import log
from kvhandoff.bench.stack import Stack, cpu_seconds, stop_on_signal
from kvhandoff.launch.supervisor import free_port


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def one(client: httpx.Client, url: str, model: str, prompt: list[int], new_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "min_tokens": new_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "return_token_ids": True}
    t0, arrivals, ids = time.perf_counter(), [], []
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                if choice.get("token_ids"):
                    arrivals.append(time.perf_counter())
                    ids += choice["token_ids"]
    ttft = (arrivals[0] - t0) * 1e3
    tpot = (arrivals[-1] - arrivals[0]) * 1e3 / max(1, len(ids) - 1)
    # The second token: the first the decode worker makes after the KV arrived (the first may come
    # from the prefill's answer, the same in pull and push; push moves the KV earlier).
    second = (arrivals[1] - t0) * 1e3 if len(arrivals) > 1 else None
    return {"ttft_ms": round(ttft, 1), "second_token_ms": second and round(second, 1), "tpot_ms": round(tpot, 2),
            "tokens": len(ids), "wall_s": time.perf_counter() - t0, "ids": ids}


def summary(rows: list[dict]) -> dict:
    return {"n": len(rows), "ttft_p50_ms": round(statistics.median(r["ttft_ms"] for r in rows), 1),
            "second_token_p50_ms": round(statistics.median(r["second_token_ms"] for r in rows), 1),
            "tpot_p50_ms": round(statistics.median(r["tpot_ms"] for r in rows), 2),
            "ttft_ms": [r["ttft_ms"] for r in rows]}


def idle_cpu_ms_per_s(pid: int, seconds: float = 5.0) -> float:
    """A router's CPU while no request is in flight (its health polls): subtracted from what requests cost."""
    before = cpu_of(pid)
    time.sleep(seconds)
    return (cpu_of(pid) - before) * 1e3 / seconds


def router_pid(stack: Stack) -> int:
    for pid in stack.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"router" in argv and b"kvhandoff.cli" in argv:
            return pid
    raise RuntimeError(f"no router in stack {stack.name}")


def cpu_of(pid: int) -> float:
    return sum(cpu_seconds([pid]).values())


def start_vllm_router(binary: str, prefill: str, decode: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([binary, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                             "--kv-connector", "nixl", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    raise TimeoutError(f"vllm-router not healthy; see {log_path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvhandoff.bench.vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, help="the interpreter vLLM and NIXL are installed in")
    p.add_argument("--vllm-router", default=None, help="vllm-router's binary (default: beside --vllm-python)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=8, help="per router and mode (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--placement", default="pin+idle", help="up --vllm-placement (default: %(default)s)")
    p.add_argument("--vllm-args", default="", help="more flags for every vLLM server, e.g. --enforce-eager")
    p.add_argument("--modes", default="colocated,pull,push")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-vllm"))
    args = p.parse_args(argv)
    router_bin = args.vllm_router or str(Path(args.vllm_python).with_name("vllm-router"))
    if "pull" in args.modes and not shutil.which(router_bin):
        raise SystemExit(f"no vllm-router at {router_bin}: {Path(args.vllm_python).with_name('pip')} install vllm-router==0.1.17")
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    stacks: list[Stack] = []
    stop_on_signal(lambda: stacks)
    common = ["--engine", "vllm", "--vllm-python", args.vllm_python, "--vllm-placement", args.placement,
              "--model", args.model, *([f"--vllm-args={args.vllm_args}"] if args.vllm_args else [])]
    results: dict = {"machine": os.uname().nodename, "load_before": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}
    client = httpx.Client(timeout=600)
    for mode in args.modes.split(","):
        stack = Stack(f"vllm-{mode}", mode, "0" if mode == "colocated" else "0,1", common, args.out / f"{mode}.log")
        stacks.append(stack)
        log(f"starting vLLM {mode} (log {stack.log_path})")
        stack.start()
        try:
            stack.wait_ready(900)
            model = stack.model_name()
            one(client, stack.url, model, prompt_ids(rng, args.prompt_len), args.new_tokens)        # warm-up
            targets = {"kvhandoff": stack.url}
            vrouter = None
            if mode == "pull":
                workers = httpx.get(stack.url + "/health", timeout=10).json()["workers"]
                urls = {w["role"]: w["url"] for w in workers}
                vrouter, vurl = start_vllm_router(router_bin, urls["prefill"], urls["decode"], args.out / "vllm-router.log")
                targets["vllm-router"] = vurl
                one(client, vurl, model, prompt_ids(rng, args.prompt_len), args.new_tokens)          # warm-up
            pids = {"kvhandoff": router_pid(stack) if mode != "colocated" else None,
                    "vllm-router": vrouter.pid if vrouter else None}
            rows = {name: [] for name in targets}
            cpu = {name: 0.0 for name in targets}
            idle = {name: idle_cpu_ms_per_s(pid) if pid else 0.0 for name, pid in pids.items() if name in targets}
            for i in range(args.requests):
                for name, url in targets.items():
                    before = cpu_of(pids[name]) if pids[name] else 0.0
                    rows[name].append(one(client, url, model, prompt_ids(rng, args.prompt_len), args.new_tokens))
                    cpu[name] += (cpu_of(pids[name]) - before) if pids[name] else 0.0
                    log(f"{mode} {name} {i + 1}/{args.requests}: TTFT {rows[name][-1]['ttft_ms']} ms, "
                        f"TPOT {rows[name][-1]['tpot_ms']} ms")
            if vrouter is not None:
                same = [one(client, url, model, prompt_ids(random.Random(7), args.prompt_len), 32)["ids"]
                        for url in targets.values()]
                results["pull_outputs_equal"] = same[0] == same[1]
                vrouter.terminate()
                vrouter.wait(10)
            for name in targets:
                key = f"{mode}" if name == "kvhandoff" else f"{mode} via {name}"
                busy_s = sum(r["wall_s"] for r in rows[name])
                results[key] = summary(rows[name]) | ({
                    "router_cpu_ms_per_request": round(cpu[name] * 1e3 / args.requests, 2),
                    "router_idle_cpu_ms_per_s": round(idle[name], 2),
                    "router_cpu_ms_per_request_less_idle": round((cpu[name] * 1e3 - idle[name] * busy_s) / args.requests, 2),
                } if pids[name] else {})
                log(f"{key}: {results[key]}")
        finally:
            stack.stop(60)
    results["load_after"] = os.getloadavg()
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    if "pull" in results and "pull via vllm-router" in results:
        print(f"pull TTFT, kvhandoff / vllm-router: {results['pull']['ttft_p50_ms'] / results['pull via vllm-router']['ttft_p50_ms']:.3f}")
    if "push" in results and "pull" in results:
        print(f"push / pull TTFT (kvhandoff): {results['push']['ttft_p50_ms'] / results['pull']['ttft_p50_ms']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
