"""A whole local stack for a benchmark: `kvhandoff up` run as a child process, ready when /health is.

The benchmark talks to it over HTTP only, like any client; this module only starts it, waits for it,
finds its processes (for the core-wait accounting) and stops it. Output goes to a log file per stack,
so a failed start can say where to look.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import httpx

from kvhandoff.bench.meta import log
from kvhandoff.launch.lifeline import child_env
from kvhandoff.launch.procs import cpu_ticks, process_tree
from kvhandoff.launch.supervisor import free_port
from kvhandoff.wire.modes import Role


@dataclass
class Stack:
    name: str                    # e.g. "colocated-1core", "push"
    mode: str                    # kvhandoff up --mode
    cores: str                   # kvhandoff up --cores
    args: list[str]              # engine / worker flags for every worker
    log_path: Path
    port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = self.port or free_port()
        cmd = [sys.executable, "-m", "kvhandoff.cli", "up", "--mode", self.mode, "--cores", self.cores,
               "--port", str(self.port), "--log-level", "warning", *self.args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # If the benchmark dies, however it dies, the kernel tells `up` to stop its stack.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=child_env(dict(os.environ)))

    def wait_ready(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stack {self.name} exited with status {self.proc.returncode}; "
                                   f"see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"stack {self.name} not healthy after {timeout:.0f} s; see {self.log_path}")

    def model_name(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=10.0).json()["data"][0]["id"]

    def pids(self) -> list[int]:
        """The launcher and every process under it (workers, router)."""
        return process_tree(self.proc.pid)

    def stop(self, timeout: float = 30.0) -> None:
        stop_all([self], timeout)


def stop_all(stacks: Iterable[Stack], timeout: float = 30.0) -> None:
    """Stop every stack at once (each `up` stops its own children): side by side rather than one after
    another, which took the demo ~8 s for its 7 stacks."""
    stacks = [s for s in stacks if s.proc is not None and s.proc.poll() is None]
    for stack in stacks:
        stack.proc.send_signal(signal.SIGTERM)      # `kvhandoff up` stops its children, router first
    deadline = time.monotonic() + timeout
    for stack in stacks:
        try:
            stack.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stack.proc.kill()
            stack.proc.wait()


def stop_on_signal(stacks: Callable[[], Iterable[Stack]]) -> None:
    """On SIGINT or SIGTERM, stop every stack `stacks()` names and exit 130 at once. Cancelling the
    event loop's task does not reliably get through the client's streams, so the handler does not rely on
    it; an interrupted run writes no results."""
    def interrupted(signum, frame):
        log(f"signal {signum}: stopping the stacks")
        stop_all(stacks())
        os._exit(130)
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)


def thread_cpu_seconds(pid: int) -> float:
    """CPU time of the live threads of one process, to the nanosecond (schedstat), where the clock
    ticks of cpu_seconds are 10 ms: a router's idle second costs it less than two. Threads that ended
    are not counted, so this is for processes whose threads live as long as they do (a router)."""
    total = 0
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                total += int(Path(task.path, "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    except OSError:
        pass
    return total / 1e9


def cpu_seconds(pids: list[int]) -> dict[str, float]:
    """CPU time (user + system) of these processes, summed by what each runs (process_role). A
    process gone meanwhile is left out."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in pids:
        role = process_role(pid)
        if role is not None:
            out[role] = out.get(role, 0.0) + cpu_ticks(f"/proc/{pid}") / ticks
    return out


def rss_kib(pid: int, field: str = "VmRSS") -> int | None:
    """A process's resident set now (VmRSS) or its high-water mark (VmHWM), or another field of its status (RssAnon), KiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def process_role(pid: int) -> str | None:
    """What a stack's process runs: `router`, `prefill`, `decode`, `worker` (colocated), `up` (the
    supervisor) or `other`; None if it is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    role = next((word for word in argv if word in ("router", "serve", "up")), "other")   # the subcommand
    if role == "serve":
        role = Role(argv[argv.index("--role") + 1]) if "--role" in argv[:-1] else Role.BOTH
        role = "worker" if role == Role.BOTH else str(role)
    return role


def core_wait_ns(pids: list[int]) -> int:
    """Nanoseconds the threads of these processes spent runnable but waiting for a CPU (schedstat):
    their difference over a measurement says whether something else shared the cores."""
    total = 0
    for pid in pids:
        try:
            for task in os.scandir(f"/proc/{pid}/task"):
                total += int(Path(task.path, "schedstat").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return total
