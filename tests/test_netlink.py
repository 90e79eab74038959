"""`kvhandoff up --link`: the decode workers behind an emulated link (a network namespace of their
own, a shaped veth pair, KV over tcp). The KV takes as long to cross as the link's rate says, the
tokens are the colocated ones, and nothing of the link is left behind however the stack ends: a
stopped stack removes it, and a stack killed outright leaves it to the next one, which removes it."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from kvhandoff.config import EngineConfig
from kvhandoff.engine.engine import LLMEngine
from kvhandoff.engine.request import SamplingParams
from kvhandoff.launch.netlink import NS_PREFIX, LinkSpec, namespaces
from test_router import UP_READY, Proc

pytestmark = pytest.mark.timeout(300)
RATE_MBIT = 20
PROMPTS = [[(i * 37 + n * 11) % 450 + 3 for n in range(1500 + 40 * i)] for i in range(3)]


@pytest.fixture(autouse=True)
def needs_a_link():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("an emulated link needs root and iproute2")


def leftovers(pid: int) -> list[str]:
    """What a `--link` stack of this pid left: its namespace, its veth end here."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [ns for ns in namespaces() if ns == f"{NS_PREFIX}{pid}"] + re.findall(rf"\bkvhl{pid}\w*", links)


def up(tmp_path, name: str, *extra: str) -> Proc:
    return Proc(["up", "--mode", "pull", "--model", "tiny", "--dtype", "float32", "--no-prefix-caching",
                 "--port", "0", *extra], tmp_path / f"{name}.log", UP_READY, timeout=120)


def test_spec_parsing():
    assert LinkSpec.parse("10gbit,50us,5us") == LinkSpec("10gbit", "50us", "5us")
    assert LinkSpec.parse("200mbit").bits_per_s == 200e6
    for bad in ("", "fast", "10GB", "1gbit,soon", "1gbit,,5us", "1gbit,1ms,1us,1us"):
        with pytest.raises(ValueError, match="--link"):
            LinkSpec.parse(bad)


def test_kv_crosses_an_emulated_link_at_its_rate_and_the_link_is_always_removed(tmp_path):
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32"))
    expected = [engine.tokenizer.decode(t) for t in
                engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    first = up(tmp_path, "first", "--link", f"{RATE_MBIT}mbit")
    try:
        assert re.search(r"emulated link 20mbit \((netem|tbf)\) between 198\.1[89]\.", first.text())
        assert leftovers(first.proc.pid), "no namespace while the stack runs"
        for prompt, text in zip(PROMPTS, expected):
            r = httpx.post(first.url + "/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            handoff = r.json()["handoff"]
            assert r.json()["choices"][0]["text"] == text
            assert re.match(r"http://198\.1[89]\.", handoff["decode_worker"]), handoff
            link_ms = handoff["bytes_transferred"] * 8 / (RATE_MBIT * 1e6) * 1e3
            transfer = handoff["phases_ms"]["transfer"]
            assert 0.8 * link_ms <= transfer <= 1.2 * link_ms, (transfer, link_ms, handoff)
        # Killed outright: its children follow it, its namespace stays ...
        first.proc.kill()
        first.proc.wait(10)
        assert leftovers(first.proc.pid)
        # ... until the next --link stack sees that its pid is gone.
        second = up(tmp_path, "second", "--link", "1gbit")
        try:
            assert not leftovers(first.proc.pid)
        finally:
            second.proc.send_signal(signal.SIGTERM)        # what `kvhandoff bench` sends when interrupted
            assert second.proc.wait(60) == 0, second.text()[-3000:]
            second.log.close()
        assert not leftovers(second.proc.pid), second.text()[-2000:]
        assert "removed the emulated link" in second.text()
    finally:
        first.stop()
        subprocess.run(["ip", "netns", "del", f"{NS_PREFIX}{first.proc.pid}"], capture_output=True)


def has_netem() -> bool:
    probe = f"kvh-probe-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True)
    try:
        return subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem"],
                              capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def test_a_delay_without_netem_is_refused_not_ignored():
    if has_netem():
        pytest.skip("this kernel has netem: a delay is emulated")
    proc = subprocess.Popen([sys.executable, "-m", "kvhandoff.cli", "up", "--mode", "pull", "--model", "tiny",
                             "--port", "0", "--link", "1gbit,1ms"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "no netem qdisc (sch_netem), which a link delay needs" in out, out[-2000:]
    assert not leftovers(proc.pid)
