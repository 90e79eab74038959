"""Shared fixtures: real `kvhandoff serve` processes (subprocesses, stopped by PID at teardown)."""
from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

READY = re.compile(r"kvhandoff: serving '(?P<name>[^']+)' at (?P<url>http://\S+)/v1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads real model weights (seconds to minutes); runs in CI too")


class ServerProcess:
    """`kvhandoff serve ... --port 0` in a subprocess; `url` is read from its ready line."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 120.0):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        # One torch thread unless a test asks for more: tests run several workers on a 2-core machine,
        # and a worker's OpenMP team spins between parallel regions while its process computes (the
        # engine's threads live on its loop thread alone), taking the cores from its neighbours.
        # `kvhandoff up` likewise gives each worker the threads of the cores it owns.
        threads = [] if "--threads" in args else ["--threads", "1"]
        cmd = [sys.executable, "-m", "kvhandoff.cli", "serve", "--port", "0", *threads, *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self.url, self.served_name = self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            m = READY.search(self.log_path.read_text(errors="replace"))
            if m and httpx.get(m["url"] + "/health", timeout=5).status_code == 200:
                return m["url"], m["name"]
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self, timeout: float = 15.0) -> int:
        self.log.close()
        return stop_process(self.proc, timeout)


def start_servers(specs: list[tuple[list[str], Path]]) -> list[ServerProcess]:
    """ServerProcess(args, log_path) for each spec, started side by side (a start is mostly importing
    torch: on two cores two at once take about as long as one). In order; if any fails to start, the
    others are stopped and its error raised."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(ServerProcess, args, log_path) for args, log_path in specs]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                f.result().stop()
        raise failed[0]
    return [f.result() for f in futures]


def may_mount() -> bool:
    """Whether this process may mount filesystems: CAP_SYS_ADMIN in its effective capabilities (root
    in a container without it may not)."""
    with open("/proc/self/status") as status:
        effective = next(line for line in status if line.startswith("CapEff:"))
    return bool(int(effective.split()[1], 16) >> 21 & 1)


@contextmanager
def stand_in_agent(worker: ServerProcess, secret: str, protocol: str | None = None):
    """A transfer agent of the deployment connected to `worker`'s, as a peer worker's is: (agent,
    the worker's peer name). `protocol`: another version's, to be refused."""
    from kvhandoff.transfer.agent import TransferAgent
    from kvhandoff.wire.auth import control_headers
    from kvhandoff.wire.messages import PROTOCOL
    info = httpx.get(f"{worker.url}/kv/info", headers=control_headers(secret), timeout=10).json()
    with TransferAgent(f"stand-in-{uuid.uuid4().hex[:8]}", secret, protocol=protocol or PROTOCOL) as agent:
        yield agent, agent.add_peer(base64.b64decode(info["agent_metadata"]))


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `timeout`; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """One `kvhandoff serve --model tiny` for the whole session (a small pool so leaks show)."""
    server = ServerProcess(["--model", "tiny", "--num-blocks", "512"],
                           tmp_path_factory.mktemp("tiny_server") / "server.log")
    server.baseline = server.health()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fleet_reference(tmp_path_factory) -> dict[int, list[str]]:
    """test_fleet's colocated reference answers, computed once for test_fleet and test_ray (which
    imports test_fleet's `reference` fixture): one colocated server and 32 greedy requests less."""
    from test_fleet import colocated_reference
    return colocated_reference(tmp_path_factory)


def prefill_answer(r: httpx.Response) -> tuple[dict | None, dict | None, dict | None]:
    """A prefill worker's answer (JSON lines): (first token, handoff object, error), as a router reads it."""
    import json
    first = handoff = error = None
    for line in r.text.splitlines():
        message = json.loads(line)
        first = message.get("first_token", first)
        handoff = message.get("handoff", handoff)
        error = message.get("error", error)
    return first, handoff, error


def prefill_handoff(r: httpx.Response) -> dict:
    """The handoff object of a prefill answer that must have succeeded."""
    assert r.status_code == 200, r.text
    first, handoff, error = prefill_answer(r)
    assert first is not None and handoff is not None and error is None, r.text
    return handoff
