"""Cross-host handoffs: a prefill worker and a decode worker in two network namespaces joined by a
veth pair (real addresses from 198.18.0.0/15, as two hosts would be), KV over the tcp backend.
Every mode must give the colocated tokens and leave both pools at baseline."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvhandoff.config import EngineConfig
from kvhandoff.engine.engine import LLMEngine
from kvhandoff.engine.request import SamplingParams
from test_handoff import COMMON, MODES, PROMPTS
from test_transfer_netns import ADDR_A, ADDR_B, two_hosts  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(300)
TESTS = Path(__file__).parent


def start_worker(ns: str, role: str, addr: str, log: Path, *extra: str) -> subprocess.Popen:
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "kvhandoff.cli", "serve", *COMMON, "--role", role,
           "--host", addr, "--port", "18300", "--kv-backend", "tcp", "--log-level", "warning", *extra]
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "KVHANDOFF_THREADS": "1"})


def run_handoffs(hosts, tmp_path: Path, *driver_args: str, prefill_args=(), decode_args=()) -> dict:
    """Start a prefill worker in one namespace and a decode worker in the other, play the router from
    the decode side's namespace, stop both; the driver's report."""
    (ns_a, _), (ns_b, _) = hosts
    prefill = start_worker(ns_a, "prefill", ADDR_A, tmp_path / "prefill.log", *prefill_args)
    decode = start_worker(ns_b, "decode", ADDR_B, tmp_path / "decode.log", *decode_args)
    try:
        run = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, str(TESTS / "netns_driver.py"),
                              f"http://{ADDR_A}:18300", f"http://{ADDR_B}:18300", *driver_args],
                             capture_output=True, text=True, timeout=240, cwd=TESTS,
                             env={**os.environ, "PYTHONPATH": str(TESTS)})
        assert run.returncode == 0, run.stderr[-3000:] + (tmp_path / "decode.log").read_text()[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        for proc in (prefill, decode):
            proc.terminate()
        for proc in (prefill, decode):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def colocated_texts(prompts: list[str]) -> list[str]:
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32"))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = engine.generate([engine.tokenizer.encode(p) for p in prompts], params)
    return [engine.tokenizer.decode(t) for t in outputs]


def test_handoff_between_two_hosts(two_hosts, tmp_path):    # noqa: F811
    report = run_handoffs(two_hosts, tmp_path)
    expected = colocated_texts(PROMPTS[:4])
    for mode in MODES:
        assert [r["text"] for r in report["results"][mode]] == expected, mode
        assert all(r["handoff"]["kv_source"] == "remote" for r in report["results"][mode])
    for health in report["health"].values():
        assert health["num_free_blocks"] == health["num_blocks"]


LINK_MBIT = 10


def shape(ns: str, dev: str, mbit: int) -> None:
    """A slow link: a token bucket on the veth end's egress (removed with its namespace)."""
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                    f"{mbit}mbit", "burst", "32kbit", "latency", "2s"], check=True, capture_output=True)


def test_layerwise_push_overlaps_a_slow_link(two_hosts, tmp_path):    # noqa: F811
    """Over a slow link, layer-wise push moves the KV while later chunks are still being computed:
    what is left after the prefill (its `transfer` phase, on the client's critical path) is a small
    fraction of the full transfer, which pull pays whole after the prefill. (It once overlapped
    nothing: a chunk's layers were sent only if written from layer 0, which a group of 5 of
    SmolLM2's 30 layers never was, and nothing at all after a registration came mid-prompt.)"""
    (ns_a, veth_a), (ns_b, veth_b) = two_hosts
    shape(ns_a, veth_a, LINK_MBIT)
    shape(ns_b, veth_b, LINK_MBIT)
    # 1,002 tokens in 16 chunks of 64, each step 200 ms longer: a ~3.5 s prefill; ~2 MB of KV: ~1.7 s
    # at 10 Mbit/s. The link can keep up with the prefill, so layer-wise push should leave little.
    # No prefix caching: the second mode must not find the first one's blocks on either side.
    slow_prefill = ("--max-num-batched-tokens", "64", "--inject-faults", "step_ms=200", "--no-prefix-caching")
    report = run_handoffs(two_hosts, tmp_path, "pull,push-layerwise", "3", prefill_args=slow_prefill,
                          decode_args=("--no-prefix-caching",))
    (pull,), (layerwise,) = report["results"]["pull"], report["results"]["push-layerwise"]
    assert [pull["text"], layerwise["text"]] == colocated_texts([PROMPTS[3]]) * 2
    assert pull["handoff"]["kv_source"] == layerwise["handoff"]["kv_source"] == "remote"
    nbytes = pull["handoff"]["bytes_transferred"]
    link_ms = nbytes * 8 / (LINK_MBIT * 1e6) * 1e3
    pull_transfer = pull["handoff"]["phases_ms"]["transfer"]
    tail = layerwise["prefill_handoff"]["phases_ms"]["transfer"]
    early = layerwise["prefill_handoff"]["bytes_before_prefill_end"]
    facts = dict(nbytes=nbytes, link_ms=link_ms, pull_transfer=pull_transfer, layerwise_tail=tail, early=early,
                 prefill_ms=layerwise["prefill_handoff"]["phases_ms"]["prefill_compute"])
    print("layer-wise over a shaped link:", facts)
    assert pull_transfer >= 0.8 * link_ms, facts          # pull waits for the whole transfer
    assert tail < 0.3 * pull_transfer, facts              # layer-wise: most of it hidden behind the prefill
    assert layerwise["prefill_handoff"]["bytes_transferred"] == nbytes, facts
    assert early >= 0.5 * nbytes, facts
