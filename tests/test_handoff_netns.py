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


def start_worker(ns: str, role: str, addr: str, log: Path) -> subprocess.Popen:
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "kvhandoff.cli", "serve", *COMMON, "--role", role,
           "--host", addr, "--port", "18300", "--kv-backend", "tcp", "--log-level", "warning"]
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "KVHANDOFF_THREADS": "1"})


def test_handoff_between_two_hosts(two_hosts, tmp_path):    # noqa: F811
    (ns_a, _), (ns_b, _) = two_hosts
    prefill = start_worker(ns_a, "prefill", ADDR_A, tmp_path / "prefill.log")
    decode = start_worker(ns_b, "decode", ADDR_B, tmp_path / "decode.log")
    try:
        run = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, str(TESTS / "netns_driver.py"),
                              f"http://{ADDR_A}:18300", f"http://{ADDR_B}:18300"],
                             capture_output=True, text=True, timeout=240, cwd=TESTS,
                             env={**os.environ, "PYTHONPATH": str(TESTS)})
        assert run.returncode == 0, run.stderr[-3000:] + (tmp_path / "decode.log").read_text()[-3000:]
        report = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        for proc in (prefill, decode):
            proc.terminate()
        for proc in (prefill, decode):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32"))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:4]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [engine.tokenizer.decode(t) for t in engine.generate(prompts, params)]
    for mode in MODES:
        assert [r["text"] for r in report["results"][mode]] == expected, mode
        assert all(r["handoff"]["kv_source"] == "remote" for r in report["results"][mode])
    for health in report["health"].values():
        assert health["num_free_blocks"] == health["num_blocks"]
