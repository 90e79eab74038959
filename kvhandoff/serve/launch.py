"""`kvhandoff up`: a whole deployment on this machine in one command.

Starts the workers (`kvhandoff serve --role prefill|decode`) and the router (`kvhandoff router`) as
child processes sharing a freshly generated secret (passed in the environment, never on a command
line that `ps` shows), waits until every /health answers, prints the URL, and watches them: if a child
dies the others are stopped and the launcher exits non-zero naming it. Ctrl-C or SIGTERM stops them
all (router first, so no new work arrives), SIGKILL after a grace period.

Colocated mode runs one plain worker that serves the front port itself, with no router in front: the
baseline disaggregation is measured against is the plain server, not the plain server plus a hop.

Cores: each worker gets its own share of the cores this process may use, or of `--cores` (prefill first: with 1+1
workers on 2 cores, prefill on core 0 and decode on core 1), pinned with sched_setaffinity and given
`--threads` to match, so torch neither oversubscribes nor steals from the neighbour. With fewer cores
than workers nothing is pinned and each worker gets an equal thread count instead. A colocated worker
is pinned to all of them (`--cores 0`: colocated on one core, the baseline a 1+1 split is compared to).
"""
from __future__ import annotations

import ctypes
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from kvhandoff.handoff.modes import COLOCATED, STACK_MODES
from kvhandoff.serve.auth import SECRET_ENV



@dataclass
class LaunchConfig:
    mode: str
    worker_args: list[str]           # engine and worker flags, passed to every worker as they are
    router_args: list[str] = field(default_factory=list)   # flags for the router (disaggregated modes)
    prefill_args: list[str] = field(default_factory=list)  # flags for prefill workers only
    decode_args: list[str] = field(default_factory=list)   # flags for decode workers only
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"          # the front (router, or the colocated worker) binds here
    port: int = 8000                 # 0 picks a free one
    threads: int = 0                 # per worker; 0 = match the cores it owns
    cores: list[int] | None = None   # the cores to share out; None = every core this process may use
    log_level: str = "info"
    startup_timeout: float = 600.0   # loading a real model on a busy CPU takes a while
    stop_timeout: float = 15.0

    def __post_init__(self):
        assert self.mode in STACK_MODES, f"mode must be one of {STACK_MODES}"
        assert self.num_prefill >= 1 and self.num_decode >= 1, "at least one prefill and one decode worker"
        if self.cores is not None:
            allowed = os.sched_getaffinity(0)
            if not self.cores or not set(self.cores) <= allowed:
                raise ValueError(f"--cores {self.cores} is not a subset of the cores this process may use "
                                 f"({','.join(map(str, sorted(allowed)))})")


@dataclass
class Child:
    name: str                        # prefill-0, decode-0, router, worker (colocated)
    cmd: list[str]
    url: str
    cores: list[int] | None = None
    proc: subprocess.Popen | None = None
    reader: threading.Thread | None = field(default=None, repr=False)

    def describe(self) -> str:
        pid = self.proc.pid if self.proc else "-"
        cores = f", cores {','.join(map(str, self.cores))}" if self.cores else ""
        return f"{self.name} (pid {pid}, {self.url}{cores})"


class ChildDied(Exception):
    def __init__(self, child: Child):
        super().__init__(f"{child.describe()} exited with status {child.proc.returncode}")
        self.child = child


def free_port(host: str = "127.0.0.1") -> int:
    """A port to pass to a child that binds it later. Drawn below the kernel's ephemeral range, not
    from it: between our check and the child's bind, any outgoing connection (our own health polls)
    or port-0 listener (a transfer agent) can be handed an ephemeral port, and a router of `kvhandoff
    demo` once failed to start on CI with "address already in use" that way."""
    low = _ephemeral_low()
    candidates = [random.randrange(max(1024, low - 16384), low) for _ in range(64)] if low > 2048 else [0]
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue                # taken: draw another
            return s.getsockname()[1]
    raise OSError(f"no free port found below {low} on {host}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                    # Linux's default


def core_shares(cores: list[int], n: int) -> list[list[int]] | None:
    """Split `cores` into n equal contiguous shares (leftovers unused); None if there are fewer than n."""
    if len(cores) < n:
        return None
    per = len(cores) // n
    return [cores[i * per:(i + 1) * per] for i in range(n)]


def kvhandoff_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvhandoff.cli", *args]


def plan(cfg: LaunchConfig) -> list[Child]:
    """The children to start, workers first, each with its command line, URL and cores."""
    cores = sorted(cfg.cores or os.sched_getaffinity(0))
    port = cfg.port or free_port(cfg.host)
    host_in_url = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    common = ["--log-level", cfg.log_level]
    if cfg.mode == COLOCATED:
        threads = cfg.threads or len(cores)
        return [Child("worker", kvhandoff_cmd("serve", "--host", cfg.host, "--port", str(port), *common,
                                              *cfg.worker_args, "--threads", str(threads)),
                      f"http://{host_in_url}:{port}", cores)]
    names = [f"prefill-{i}" for i in range(cfg.num_prefill)] + [f"decode-{i}" for i in range(cfg.num_decode)]
    shares = core_shares(cores, len(names))
    children = []
    for i, name in enumerate(names):
        share = shares[i] if shares else None
        threads = cfg.threads or (len(share) if share else max(1, len(cores) // len(names)))
        wport = free_port()
        # Workers bind loopback whatever --host says: only the router is meant to be reached from outside.
        role = name.split("-")[0]
        own = cfg.prefill_args if role == "prefill" else cfg.decode_args
        cmd = kvhandoff_cmd("serve", "--role", role, "--host", "127.0.0.1", "--port", str(wport),
                            *common, *cfg.worker_args, *own, "--threads", str(threads))
        children.append(Child(name, cmd, f"http://127.0.0.1:{wport}", share))
    urls = lambda role: ",".join(c.url for c in children if c.name.startswith(role))
    children.append(Child("router", kvhandoff_cmd("router", "--prefill", urls("prefill"), "--decode", urls("decode"),
                                                  "--mode", cfg.mode, "--host", cfg.host, "--port", str(port),
                                                  *common, *cfg.router_args),
                          f"http://{host_in_url}:{port}"))
    return children


def die_with_parent() -> None:
    """preexec_fn: the kernel sends the child SIGTERM if the launcher dies without cleaning up (SIGKILL)."""
    PR_SET_PDEATHSIG = 1
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


_libc = ctypes.CDLL(None, use_errno=True)   # loaded before any fork: preexec_fn must not import


def start(children: list[Child], env: dict[str, str]) -> None:
    # Every child starts before any output thread exists: preexec_fn is only safe without other threads.
    for child in children:
        child.proc = subprocess.Popen(child.cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,  # Ctrl-C is ours to pass on
                                      preexec_fn=die_with_parent)
        if child.cores:
            # Right after spawn, long before the child imports torch, so every thread it makes inherits it.
            os.sched_setaffinity(child.proc.pid, child.cores)
    for child in children:
        child.reader = threading.Thread(target=forward_output, args=(child,), daemon=True, name=f"out-{child.name}")
        child.reader.start()


def forward_output(child: Child) -> None:
    """Copy a child's output to ours, each line prefixed with its name."""
    prefix = f"[{child.name}] ".encode()
    for line in iter(child.proc.stdout.readline, b""):
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.buffer.flush()


def check_alive(children: list[Child]) -> None:
    for child in children:
        if child.proc.poll() is not None:
            raise ChildDied(child)


def wait_ready(children: list[Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(children)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            check_alive(children)
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout:.0f} s: {', '.join(c.describe() for c in pending)}")
            for child in list(pending):
                try:
                    if client.get(child.url + "/health").status_code == 200:
                        pending.remove(child)
                except httpx.HTTPError:
                    pass
            time.sleep(0.25)


def served_name(url: str) -> str:
    try:
        return httpx.get(url + "/v1/models", timeout=5.0).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return "?"


def stop(children: list[Child], timeout: float) -> None:
    """SIGTERM the router first, then the workers; SIGKILL whatever is left after `timeout`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a second Ctrl-C must not cut the cleanup short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ordered = sorted((c for c in children if c.proc), key=lambda c: c.name != "router")
    for child in ordered:
        if child.proc.poll() is None:
            child.proc.terminate()
    deadline = time.monotonic() + timeout
    for child in ordered:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"kvhandoff up: {child.describe()} did not stop within {timeout:g} s; killing it", flush=True)
            child.proc.kill()
            child.proc.wait()
    for child in ordered:
        if child.reader:
            child.reader.join(timeout=2.0)


def run(cfg: LaunchConfig) -> int:
    children = plan(cfg)
    env = {**os.environ, SECRET_ENV: secrets.token_hex(32), "PYTHONUNBUFFERED": "1"}
    try:
        start(children, env)
        for child in children:
            print(f"kvhandoff up: started {child.describe()}", flush=True)
        wait_ready(children, cfg.startup_timeout)
        front = children[-1].url
        print(f"kvhandoff: serving '{served_name(front)}' at {front}/v1 (mode {cfg.mode}; health {front}/health, "
              f"metrics {front}/metrics; Ctrl-C stops everything)", flush=True)
        while True:
            check_alive(children)
            time.sleep(0.5)
    except ChildDied as e:
        print(f"kvhandoff up: {e}; stopping the others (its output is above, prefixed [{e.child.name}])",
              flush=True)
        return 1
    except TimeoutError as e:
        print(f"kvhandoff up: {e}; stopping everything", flush=True)
        return 1
    finally:
        stop(children, cfg.stop_timeout)
        print("kvhandoff up: stopped", flush=True)
