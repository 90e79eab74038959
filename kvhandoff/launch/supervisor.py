"""`kvhandoff up`: a whole deployment on this machine in one command.

Starts the workers (`kvhandoff serve --role prefill|decode`) and the router (`kvhandoff router`) as
child processes sharing one secret ($KVHANDOFF_SECRET, else a freshly generated one; passed in the
environment, never on a command line that `ps` shows), waits until every /health answers, prints
the URL, and supervises them: a worker that dies is restarted on its own port and cores after a
backoff (1, 2, 4 ... 30 s), and the router's health poll takes it back into rotation when it
answers again, while the others keep serving. A worker that dies `max_restarts` times within `restart_window` seconds is given up (a
crash loop: a bad flag, a model that does not load); the stack stops only when a role has no worker
left, when the router dies, or on Ctrl-C or SIGTERM (router first, so no new work arrives; SIGKILL
after a grace period).

`--routers N` (N > 1) starts N routers that all listen on the front port (SO_REUSEPORT: the kernel
spreads client connections over them) and each on a port of its own, where the supervisor checks it.
A router that dies is then restarted like a worker, and the others serve meanwhile; its own
in-flight requests end with it. With --bidirectional they find each conversation through the decode
workers (`--shared-sessions`), so a turn may land on any of them.

Colocated mode runs one plain worker that serves the front port itself, with no router in front: the
baseline disaggregation is measured against is the plain server, not the plain server plus a hop.

Cores: each worker gets its own share of the cores this process may use, or of `--cores` (prefill first: with 1+1
workers on 2 cores, prefill on core 0 and decode on core 1), pinned with sched_setaffinity and given
`--threads` to match, so torch neither oversubscribes nor steals from the neighbour. With fewer cores
than workers nothing is pinned and each worker gets an equal thread count instead. A colocated worker
is pinned to all of them (`--cores 0`: colocated on one core, the baseline a 1+1 split is compared to).
The router goes on the prefill workers' cores (`router_cores`): the kernel had woken it on the decode
worker's core for each token it relays.

KV pools: where /dev/shm gives 4 KiB pages and this process may mount filesystems, the workers keep
their shared-memory KV pools in a huge-page tmpfs that only this stack's processes see
(transfer/huge_tmpfs.py): same-host copies and the decode steps that read the pool run on 2 MiB pages,
as a colocated engine's private pool does. Not where a flag names --kv-shm-dir, nor with --link.

`--link RATE[,DELAY[,JITTER]]` puts the decode workers behind an emulated link (netlink.py): they run
in a network namespace of their own, the prefill workers and the router here, and the KV crosses a
shaped veth pair over the tcp backend, removed again when the stack stops.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from kvhandoff.launch.lifeline import child_env
from kvhandoff.launch.netlink import EmulatedLink, LinkError, LinkSpec
from kvhandoff.launch.vllm import VllmLaunch
from kvhandoff.transfer.huge_tmpfs import ShmDir, private_huge_tmpfs
from kvhandoff.wire.auth import SECRET_ENV, control_headers
from kvhandoff.wire.modes import COLOCATED, STACK_MODES, Role

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)   # before the 1st, 2nd, ... restart within the window


@dataclass
class LaunchConfig:
    mode: str
    worker_args: list[str]           # engine and worker flags, passed to every worker as they are
    router_args: list[str] = field(default_factory=list)   # flags for the router (disaggregated modes)
    prefill_args: list[str] = field(default_factory=list)  # flags for prefill workers only
    decode_args: list[str] = field(default_factory=list)   # flags for decode workers only
    num_prefill: int = 1
    num_decode: int = 1
    num_routers: int = 1             # > 1: routers sharing the front port, each restarted like a worker
    host: str = "127.0.0.1"          # the front (router, or the colocated worker) binds here
    port: int = 8000                 # 0 picks a free one
    threads: int = 0                 # per worker; 0 = match the cores it owns
    cores: list[int] | None = None   # the cores to share out; None = every core this process may use
    log_level: str = "info"
    startup_timeout: float = 600.0   # loading a real model on a busy CPU takes a while
    stop_timeout: float = 15.0
    max_restarts: int = 5            # a worker dying this often within restart_window is given up
    restart_window: float = 300.0
    child_args: dict[str, list[str]] = field(default_factory=dict)  # flags for one child: {"decode-1": [...]}
    link: LinkSpec | None = None     # decode workers behind an emulated link (netlink.py)
    vllm: VllmLaunch | None = None   # the workers are vLLM servers (launch/vllm.py), not ours
    # Where the router runs when the workers are pinned: "prefill" (on the prefill workers' cores) or
    # "any" (unpinned: the kernel places it). Left to the kernel it ran beside the decode worker whose
    # tokens it relays: each token's write from the decode worker wakes it on the writer's core. Tiny
    # model, 1+1 on a 2-core AVX2 EPYC, the decode worker's own step at 2,048 tokens against colocated
    # on the same core, every step timed in the workers (issue 46): "any" 1.12x (pull) and 1.20x
    # (push-layerwise), "prefill" 1.02x and 0.98x. What the handoff adds to TTFT beyond the prefill's
    # own compute moved within noise (24 alternated rounds: pull +2.3/+2.2 ms at 2,048 tokens, push
    # +1.8/+1.6 at 512, push-layerwise +1.7/+1.8 at 512; "any"/"prefill"). (A 2-core Zen 4 had
    # measured "prefill" 2.4 ms worse for push at 512 tokens, with the step judged across the cores.)
    router_cores: str = "prefill"

    def __post_init__(self):
        assert self.mode in STACK_MODES, f"mode must be one of {STACK_MODES}"
        assert self.num_prefill >= 1 and self.num_decode >= 1, "at least one prefill and one decode worker"
        if self.num_routers < 1:
            raise ValueError("--routers must be >= 1")
        if self.num_routers > 1 and self.mode == COLOCATED:
            raise ValueError("--routers is for the disaggregated modes; colocated runs no router")
        names = worker_names(self)
        unknown = sorted(set(self.child_args) - set(names))
        if unknown:
            raise ValueError(f"--worker-args names {', '.join(unknown)}, but this stack's workers are "
                             f"{', '.join(names)}")
        if self.link is not None and self.mode == COLOCATED:
            raise ValueError("--link puts a link between prefill and decode workers; colocated has none")
        if self.vllm is not None and self.link is not None:
            raise ValueError("--link is for our own workers (KV over our tcp backend); --engine vllm moves KV with NIXL")
        if self.max_restarts < 0 or self.restart_window <= 0:
            raise ValueError("--max-restarts must be >= 0 and the restart window > 0")
        if self.cores is not None:
            allowed = os.sched_getaffinity(0)
            if not self.cores or not set(self.cores) <= allowed:
                raise ValueError(f"--cores {self.cores} is not a subset of the cores this process may use "
                                 f"({','.join(map(str, sorted(allowed)))})")


ROUTER = "router"       # a router child's name (more routers: router-1, ...); a worker's begins with its role


def child_role(name: str) -> Role | None:
    """The role of the worker child `name` (prefill-0, decode-1; `worker`: colocated); None: a router."""
    prefix = name.split("-")[0]
    return None if prefix == ROUTER else Role.BOTH if prefix == "worker" else Role(prefix)


def worker_names(cfg: LaunchConfig) -> list[str]:
    if cfg.mode == COLOCATED:
        return ["worker"]
    return [f"prefill-{i}" for i in range(cfg.num_prefill)] + [f"decode-{i}" for i in range(cfg.num_decode)]


@dataclass
class Child:
    name: str                        # prefill-0, decode-0, router, worker (colocated)
    cmd: list[str]
    url: str
    cores: list[int] | None = None
    proc: subprocess.Popen | None = None
    reader: threading.Thread | None = field(default=None, repr=False)
    ready: bool = False              # its /health answered 200 since it was last started
    deaths: list[float] = field(default_factory=list)   # monotonic times it died, within the window
    restart_at: float | None = None  # dead, to be started again then
    given_up: bool = False
    env: dict[str, str] = field(default_factory=dict)   # its own, beside the stack's (vLLM's side channel)

    @property
    def role(self) -> Role | None:
        """Its role as a worker; None for a router."""
        return child_role(self.name)

    def describe(self) -> str:
        pid = self.proc.pid if self.proc else "-"
        cores = f", cores {','.join(map(str, self.cores))}" if self.cores else ""
        return f"{self.name} (pid {pid}, {self.url}{cores})"


class ChildDied(Exception):
    def __init__(self, child: Child):
        super().__init__(f"{child.describe()} exited with status {child.proc.returncode}")
        self.child = child


class StackDown(Exception):
    """No worker of a role is left (every one given up): nothing can be served."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port to pass to a child that binds it later. Drawn below the kernel's ephemeral range, not
    from it: between our check and the child's bind, any outgoing connection (our own health polls)
    or port-0 listener (a transfer agent) can be handed an ephemeral port, and a router of `kvhandoff
    demo` once failed to start on CI with "address already in use" that way. And never one that any
    kvhandoff process on this machine handed out in the last PORT_HOLD_S (a shared registry): the demo
    starts seven stacks at once, each drawing its own ports, and on CI one stack's router once took
    the port drawn for another's prefill worker, so that stack's router talked to the wrong server."""
    low = _ephemeral_low()
    candidates = [random.randrange(max(1024, low - 16384), low) for _ in range(256)] if low > 2048 else [0]
    with _port_registry() as recent:
        for port in candidates:
            if port in recent:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue                # taken: draw another
                port = s.getsockname()[1]
            recent[port] = time.time()
            return port
    raise OSError(f"no free port found below {low} on {host}")


PORT_REGISTRY = Path(tempfile.gettempdir()) / "kvhandoff-ports"
PORT_HOLD_S = 300.0     # long enough for a child to start and bind what it was given


@contextlib.contextmanager
def _port_registry():
    """{port: when handed out} of every kvhandoff process here, under an exclusive lock, written back
    (older entries dropped) on leaving. Without a writable temp dir: an empty one, kept by nobody."""
    try:
        fd = os.open(PORT_REGISTRY, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield {}
        return
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        now, recent = time.time(), {}
        for line in f.read().split():
            port, _, at = line.partition("@")
            try:
                if now - float(at) < PORT_HOLD_S:
                    recent[int(port)] = float(at)
            except ValueError:
                continue            # a line another version wrote, or a torn one: dropped
        yield recent
        f.seek(0)
        f.truncate()
        f.write(" ".join(f"{port}@{at:.0f}" for port, at in recent.items()))


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


def plan(cfg: LaunchConfig, link: EmulatedLink | None = None) -> list[Child]:
    """The children to start, workers first, each with its command line, URL and cores."""
    cores = sorted(cfg.cores or os.sched_getaffinity(0))
    port = cfg.port or free_port(cfg.host)
    host_in_url = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    common = ["--log-level", cfg.log_level]
    if cfg.vllm is not None:
        return plan_vllm(cfg, cores, port)
    if cfg.mode == COLOCATED:
        threads = cfg.threads or len(cores)
        return [Child("worker", kvhandoff_cmd("serve", "--host", cfg.host, "--port", str(port), *common,
                                              *cfg.worker_args, *cfg.child_args.get("worker", []),
                                              "--threads", str(threads)),
                      f"http://{host_in_url}:{port}", cores)]
    names = worker_names(cfg)
    shares = core_shares(cores, len(names))
    children = []
    for i, name in enumerate(names):
        share = shares[i] if shares else None
        threads = cfg.threads or (len(share) if share else max(1, len(cores) // len(names)))
        wport = free_port()
        # Workers bind loopback whatever --host says: only the router is meant to be reached from outside.
        # Behind an emulated link, each binds its end of it (and the KV goes over tcp, as between hosts).
        role = child_role(name)
        own = cfg.prefill_args if role == Role.PREFILL else cfg.decode_args
        whost, prefix, over_link = "127.0.0.1", [], []
        if link is not None:
            whost = link.far_addr if role == Role.DECODE else link.near_addr
            prefix = link.prefix if role == Role.DECODE else []
            over_link = ["--kv-backend", "tcp"]
        cmd = prefix + kvhandoff_cmd("serve", "--role", role, "--host", whost, "--port", str(wport), *common,
                                     *cfg.worker_args, *own, *cfg.child_args.get(name, []), *over_link,
                                     "--threads", str(threads))
        children.append(Child(name, cmd, f"http://{whost}:{wport}", share))
    urls = lambda role: [c.url for c in children if c.role == role]
    prefill_cores = sorted({core for c in children if c.role == Role.PREFILL for core in c.cores or []})
    router_cores = prefill_cores if cfg.router_cores == "prefill" and prefill_cores else None
    return children + router_children(cfg, urls(Role.PREFILL), urls(Role.DECODE), port, router_cores)


def plan_vllm(cfg: LaunchConfig, cores: list[int], port: int) -> list[Child]:
    """The same stack with vLLM servers as its workers (launch/vllm.py), each on its share of the cores."""
    vllm = cfg.vllm
    host_in_url = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    if cfg.mode == COLOCATED:
        return [Child("worker", vllm.command(Role.BOTH, cfg.mode, cfg.host, port) + cfg.child_args.get("worker", []),
                      f"http://{host_in_url}:{port}", cores, env=vllm.env(cores, None))]
    names = worker_names(cfg)
    # With fewer cores than workers they take turns (vLLM binds its compute threads to named cores: left
    # unbound, its NIXL connector puts every worker's compute on the last core).
    shares = core_shares(cores, len(names)) or [[cores[i % len(cores)]] for i in range(len(names))]
    children = []
    for i, name in enumerate(names):
        share = shares[i]
        role, wport = child_role(name), free_port()
        own = cfg.prefill_args if role == Role.PREFILL else cfg.decode_args      # (vLLM's flags, for one role)
        cmd = vllm.command(role, cfg.mode, "127.0.0.1", wport) + own + cfg.child_args.get(name, [])
        children.append(Child(name, cmd, f"http://127.0.0.1:{wport}", share, env=vllm.env(share, free_port())))
    urls = lambda role: [c.url for c in children if c.role == role]
    return children + router_children(cfg, urls(Role.PREFILL), urls(Role.DECODE), port)


def router_children(cfg: LaunchConfig, prefill_urls: list[str], decode_urls: list[str], port: int,
                    cores: list[int] | None = None) -> list[Child]:
    """The router (on the front port), or several: each on a port of its own (the supervisor's health
    checks, an operator's look at one router) and on the shared front port; sessions are then found
    through the decode workers."""
    host_in_url = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    router = ["router", "--prefill", ",".join(prefill_urls), "--decode", ",".join(decode_urls), "--mode", cfg.mode,
              "--host", cfg.host, "--log-level", cfg.log_level, *cfg.router_args]
    if cfg.vllm is not None:
        router += ["--engine", "vllm", "--retention-ttl", str(cfg.vllm.retention_ttl)]
    if cfg.num_routers == 1:
        return [Child(ROUTER, kvhandoff_cmd(*router, "--port", str(port)), f"http://{host_in_url}:{port}", cores)]
    # (vLLM workers keep no session index to ask: each router has its own map then)
    shared = ["--front-port", str(port)] + (["--shared-sessions"] if "--bidirectional" in cfg.router_args
                                            and cfg.vllm is None else [])
    children = []
    for i in range(cfg.num_routers):
        rport = free_port(cfg.host if cfg.host not in ("0.0.0.0", "::") else "127.0.0.1")
        children.append(Child(f"router-{i}", kvhandoff_cmd(*router, "--port", str(rport), *shared),
                              f"http://{host_in_url}:{rport}", cores))
    return children


def front_url(cfg: LaunchConfig, children: list[Child]) -> str:
    """Where clients go: the one router's (or colocated worker's) URL, or the routers' shared port."""
    last = children[-1]
    if last.role is not None or cfg.num_routers == 1:
        return last.url
    return last.url.rsplit(":", 1)[0] + ":" + last.cmd[last.cmd.index("--front-port") + 1]


def spawn(child: Child, env: dict[str, str]) -> None:
    """Start (or start again) one child, with a thread that forwards its output."""
    child.proc = subprocess.Popen(child.cmd, env=child_env({**env, **child.env}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)   # Ctrl-C is ours to pass on
    if child.cores:
        # Right after spawn, long before the child imports torch, so every thread it makes inherits it.
        try:
            os.sched_setaffinity(child.proc.pid, child.cores)
        except ProcessLookupError:      # died at once; the supervisor will see it
            pass
    child.ready, child.restart_at = False, None
    child.reader = threading.Thread(target=forward_output, args=(child,), daemon=True, name=f"out-{child.name}")
    child.reader.start()


def forward_output(child: Child) -> None:
    """Copy a child's output to ours, each line prefixed with its name."""
    prefix = f"[{child.name}] ".encode()
    proc = child.proc                   # this run's: a restart gives the child a new one and a new reader
    for line in iter(proc.stdout.readline, b""):
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.buffer.flush()


def kill_group(child: Child) -> None:
    """SIGKILL what is left of a child's process group (its own session, spawn): processes it started
    that outlived it, such as a vLLM server's engine core and worker, which spin on a core each."""
    try:
        os.killpg(child.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def on_death(child: Child, cfg: LaunchConfig, now: float) -> None:
    """A worker died: restart it after a backoff, or give it up if it keeps dying."""
    kill_group(child)
    status = child.proc.returncode
    child.deaths = [t for t in child.deaths if now - t < cfg.restart_window] + [now]
    if len(child.deaths) > cfg.max_restarts:
        child.given_up = True
        print(f"kvhandoff up: {child.describe()} exited with status {status}, {len(child.deaths)} times within "
              f"{cfg.restart_window:g} s; giving up on it (its output is above, prefixed [{child.name}]); "
              "the others keep serving", flush=True)
        return
    delay = BACKOFF_S[min(len(child.deaths), len(BACKOFF_S)) - 1]
    child.restart_at = now + delay
    print(f"kvhandoff up: {child.describe()} exited with status {status}; restarting it in {delay:g} s "
          f"(restart {len(child.deaths)} of at most {cfg.max_restarts} within {cfg.restart_window:g} s); "
          "the others keep serving", flush=True)


def reap(children: list[Child], cfg: LaunchConfig, now: float) -> None:
    """Notice dead children. The one router's death ends the stack; a worker's does not, nor one of
    several routers' (the others serve the shared port while it restarts)."""
    for child in children:
        if child.given_up or child.restart_at is not None or child.proc.poll() is None:
            continue
        if child.name == ROUTER:
            raise ChildDied(child)
        on_death(child, cfg, now)
    for role in {c.role for c in children if c.name != ROUTER}:       # (None: the other routers)
        if all(c.given_up for c in children if c.role == role):
            what = ROUTER if role is None else "worker" if role == Role.BOTH else f"{role} worker"
            raise StackDown(f"every {what} has been given up; nothing can be served")


def poll_ready(children: list[Child], client: httpx.Client) -> list[Child]:
    """Children whose /health answered 200 for the first time since they were (re)started."""
    became = []
    for child in children:
        if child.ready or child.given_up or child.restart_at is not None or child.proc.poll() is not None:
            continue
        try:
            if client.get(child.url + "/health").status_code == 200:
                child.ready = True
                became.append(child)
        except httpx.HTTPError:
            pass
    return became


def router_sees_ready(routers: list[Child], worker_urls: list[str], client: httpx.Client) -> bool:
    """Whether every router's own view has these (ready) workers healthy. A router may have polled a
    worker before it listened and will not look again for up to --health-interval: announcing the stack
    before that sent every first request to the workers that happened to start first (a CI run once
    put all 8 streams on one of two decode workers). A router's /health polls every worker afresh."""
    for router in routers:
        if router.given_up:
            continue
        try:
            reports = client.get(router.url + "/health").json().get("workers", [])
        except (httpx.HTTPError, ValueError, AttributeError):
            return False
        healthy = {r.get("url") for r in reports if isinstance(r, dict) and r.get("status") == "ok"}
        if not set(worker_urls) <= healthy:
            return False
    return True


def tend(children: list[Child], cfg: LaunchConfig, env: dict[str, str], client: httpx.Client, serving: bool,
         now: float) -> None:
    """One round of looking after the children: the dead noticed (reap), those due started again, and
    (once the stack serves) those that came back said."""
    reap(children, cfg, now)
    for child in children:
        if child.restart_at is not None and now >= child.restart_at:
            spawn(child, env)
            print(f"kvhandoff up: restarted {child.describe()}", flush=True)
    for child in poll_ready(children, client):
        if cfg.vllm is not None and child.role is not None and child.cores and cfg.vllm.placement != "vllm":
            from kvhandoff.launch.vllm import place
            said = place(child.proc.pid, child.cores, idle_spinners=cfg.vllm.placement == "pin+idle")
            print(f"kvhandoff up: {child.name}: {said}", flush=True)
        if serving:
            print(f"kvhandoff up: {child.describe()} is serving again", flush=True)


def supervise(children: list[Child], cfg: LaunchConfig, env: dict[str, str]) -> None:
    """Until the stack must stop: restart dead workers, say when the stack (or a worker) serves."""
    deadline = time.monotonic() + cfg.startup_timeout
    serving = False
    # The control token: it passes an API key gate (--api-key) whatever paths it leaves open.
    with httpx.Client(timeout=2.0, headers=control_headers(env[SECRET_ENV])) as client:
        while True:
            now = time.monotonic()
            tend(children, cfg, env, client, serving, now)
            if not serving:
                routers = [c for c in children if c.role is None]
                workers = [c.url for c in children if c.role is not None and c.ready]
                if all(c.ready or c.given_up for c in children) and router_sees_ready(routers, workers, client):
                    serving = True
                    front = front_url(cfg, children)
                    print(f"kvhandoff: serving '{served_name(front)}' at {front}/v1 (mode {cfg.mode}; health "
                          f"{front}/health, metrics {front}/metrics; Ctrl-C stops everything)", flush=True)
                elif now > deadline:
                    pending = [c for c in children if not (c.ready or c.given_up)]
                    raise TimeoutError(f"not healthy after {cfg.startup_timeout:.0f} s: "
                                       f"{', '.join(c.describe() for c in pending)}")
            time.sleep(0.25 if not serving else 0.5)


def served_name(url: str) -> str:
    try:
        return httpx.get(url + "/v1/models", timeout=5.0).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return "?"


def stop(children: list[Child], timeout: float) -> None:
    """SIGTERM the router first, then the workers; SIGKILL whatever is left after `timeout`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a second Ctrl-C must not cut the cleanup short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ordered = sorted((c for c in children if c.proc), key=lambda c: c.role is not None)
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
        kill_group(child)
    for child in ordered:
        if child.reader:
            child.reader.join(timeout=2.0)


def kv_pools_dir(cfg: LaunchConfig) -> ShmDir | None:
    """Where our P/D workers' shared-memory KV pools go, unless a flag names it: a huge-page tmpfs
    private to this stack where this process may mount one (huge_tmpfs.py). Run from the thread that
    spawns the children, before it spawns them: they inherit its mount namespace."""
    if cfg.mode == COLOCATED or cfg.vllm is not None:
        return None         # no shared pool: a colocated engine's is private, on huge pages already
    if cfg.link is not None:
        # The link's network namespace is a mount under /run/netns that `ip netns` must make and remove
        # where the host sees it, not inside a mount namespace of ours; its KV crosses tcp anyway.
        return None
    given = [cfg.worker_args, cfg.prefill_args, cfg.decode_args, *cfg.child_args.values()]
    if any(a == "--kv-shm-dir" or a.startswith("--kv-shm-dir=") for args in given for a in args):
        return None
    return private_huge_tmpfs()


def run(cfg: LaunchConfig) -> int:
    link = EmulatedLink(cfg.link) if cfg.link is not None else None
    children: list[Child] = []
    pools = kv_pools_dir(cfg)
    if pools is not None:
        print(f"kvhandoff up: KV pools: {pools.why}", flush=True)
        if pools.mounted:
            cfg = replace(cfg, worker_args=[*cfg.worker_args, "--kv-shm-dir", pools.path])
    # $KVHANDOFF_SECRET if set, so workers started by hand can join later (`kvhandoff workers add`).
    env = {**os.environ, SECRET_ENV: os.environ.get(SECRET_ENV) or secrets.token_hex(32), "PYTHONUNBUFFERED": "1"}
    try:
        if link is not None:
            link.up()
            print(f"kvhandoff up: {link.describe()}", flush=True)
        children = plan(cfg, link)
        for child in children:
            spawn(child, env)
            print(f"kvhandoff up: started {child.describe()}", flush=True)
        supervise(children, cfg, env)
    except ChildDied as e:
        print(f"kvhandoff up: {e}; stopping the others (its output is above, prefixed [{e.child.name}])",
              flush=True)
        return 1
    except (TimeoutError, StackDown, LinkError) as e:
        print(f"kvhandoff up: {e}; stopping everything", flush=True)
        return 1
    finally:
        stop(children, cfg.stop_timeout)
        if pools is not None:
            pools.close()
        if link is not None:
            link.down()
            print(f"kvhandoff up: removed the emulated link (namespace {link.ns})", flush=True)
        print("kvhandoff up: stopped", flush=True)
