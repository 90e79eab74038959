"""`kvhandoff up --ray [ADDRESS]`: the stack `kvhandoff up` starts, its workers placed on a Ray cluster.

Each prefill and decode worker is a Ray actor (WorkerHost) that Ray places by the worker's demand:
`--threads` CPUs (1 by default) and the role's resources (`--prefill-resources`, `--decode-resources`:
custom resources the nodes were started with, e.g. `ray start --resources '{"decode_node": 4}'`).
The actor starts `kvhandoff serve` on its node, bound to the node's own address, KV over `tcp`
there, the deployment secret in the process's environment (never on a command line), and watches
it: when the worker exits, the actor exits too, and Ray restarts the actor (its restart policy,
`--max-restarts`), on another node if its node is gone and resources allow.

The routers run here, beside this driver, as with plain `up`. Which workers exist is Ray's to say:
the driver asks every actor for its worker (URL, run id) every half second and tells each router
(its `/admin/workers`, with the control token) when one was restarted at a new address and the old
one drained. A worker whose actor Ray cannot restart is given up; the stack stops when a role has
none left, when the (one) router dies, or on Ctrl-C or SIGTERM, which stop the routers, then the
actors (each worker dies with its actor: launch/lifeline.py).

ADDRESS is what `ray.init` takes (`HOST:PORT` of the head's GCS); `auto` or none: the cluster this
machine belongs to, else a one-node cluster started on the spot and shut down with the stack. Bad
set-ups say so at once: Ray not installed, an address nothing answers at, a fleet the cluster cannot
place after `--placement-timeout` (which resource is short), nodes whose addresses cannot reach each
other (both named). Nothing here imports Ray unless `--ray` was given.
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

import httpx

from kvhandoff.launch.lifeline import child_env
from kvhandoff.launch.supervisor import (COLOCATED, ChildDied, child_role, LaunchConfig, StackDown, free_port, front_url,
                                         kvhandoff_cmd, router_children, router_sees_ready, served_name, spawn, stop,
                                         tend, worker_names)
from kvhandoff.wire.auth import SECRET_ENV, control_headers
from kvhandoff.wire.modes import ROLES, Role

INSTALL_HINT = "pip install 'kvhandoff[ray]' (or: pip install ray)"
FOLLOW_INTERVAL_S = 0.5
RESTART_READY_S = 600.0                 # a restarted worker loads its model again
GIVE_UP_AFTER_DIED_ERRORS = 3


class RaySetupError(RuntimeError):
    """A set-up the cluster cannot run; the message says what to change."""


@dataclass
class RayConfig:
    address: str | None = None                        # None / "auto": this machine's cluster, else a new one
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    placement_timeout: float = 60.0


def parse_resources(spec: str) -> dict[str, float]:
    """'decode_node=1,memory_gb=2' -> {'decode_node': 1.0, 'memory_gb': 2.0}."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, amount = part.partition("=")
        try:
            value = float(amount) if sep else 1.0
        except ValueError:
            value = -1.0
        if not name.strip() or value <= 0:
            raise ValueError(f"not a resource list: {spec!r} (e.g. decode_node=1 or gpu_node=1,big=2)")
        out[name.strip()] = value
    return out


# ---------------------------------------------------------------------------------------------------
# On the node Ray placed it on

class WorkerHost:
    """One kvhandoff worker: its `serve` process on this node, watched. Methods run while __init__'s
    process lives; when the worker exits, this actor exits with it, and Ray restarts the actor."""

    def __init__(self, name: str, role: Role, argv: list[str], secret: str, threads: int, loopback: bool = False):
        import ray
        self.name, self.role = name, role
        # The node's own address, which the other nodes reach; loopback on a one-node cluster the driver
        # started itself (Ray will not take 127.0.0.1 as a node's address, but nothing else needs this one).
        self.node_ip = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        port = free_port(self.node_ip)
        self.url = f"http://{self.node_ip}:{port}"
        self.run_id = secrets.token_hex(6)            # a restart is a new run (the routers' pool keys on it)
        cmd = kvhandoff_cmd("serve", "--role", role, "--host", self.node_ip, "--port", str(port), "--kv-backend", "tcp",
                            *argv, "--threads", str(threads))
        env = child_env({**os.environ, SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"})
        # Its output is this actor's, which Ray forwards to the driver's terminal (prefixed with the actor).
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        self.stopping = False
        threading.Thread(target=self._watch, daemon=True, name="watch-worker").start()

    def _watch(self) -> None:
        status = self.proc.wait()
        if not self.stopping:
            print(f"kvhandoff: {self.name} (pid {self.proc.pid}, {self.url}) exited with status {status}; "
                  "its actor exits so that Ray restarts it", flush=True)
            os._exit(1)

    def info(self) -> dict:
        return {"name": self.name, "role": self.role, "url": self.url, "pid": self.proc.pid, "node_ip": self.node_ip,
                "run_id": self.run_id}

    def ready(self, timeout: float) -> dict:
        """Until the worker's /health answers 200 (its model loaded); its info then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self.info()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} on {self.node_ip} did not serve within {timeout:.0f} s")

    def unreachable(self, urls: list[str]) -> list[str]:
        """Of the other workers' URLs, those this node cannot open a connection to (with why)."""
        failed = []
        for url in urls:
            host, _, port = url.removeprefix("http://").rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=3.0).close()
            except OSError as e:
                failed.append(f"{url} ({e.strerror or e})")
        return failed

    def stop(self) -> None:
        self.stopping = True
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---------------------------------------------------------------------------------------------------
# The driver

def import_ray():
    # Each worker's lines with its own actor and node (Ray folds equal lines of several actors into one
    # otherwise), and no usage report sent anywhere.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise RaySetupError(f"--ray needs Ray, which is not installed here: {INSTALL_HINT}") from None
    return ray


def connect(ray, address: str | None, cpus_needed: int) -> bool:
    """Join the cluster; True if a one-node cluster was started here (to be shut down with the stack),
    with as many CPUs as the fleet asks for if this machine has fewer (as plain `up` shares them)."""
    quiet = {"logging_level": "warning", "configure_logging": True}
    if address in (None, "auto"):
        found = this_machines_cluster(ray)
        failure = None if found is None else answers(found)
        if found is None or failure is not None:
            why = ("no Ray cluster on this machine" if found is None else
                   f"the Ray cluster last started here ({found}) does not answer ({failure})")
            print(f"kvhandoff up: {why}; starting a one-node cluster (the workers on 127.0.0.1)", flush=True)
            # "local": a new cluster, whatever $RAY_ADDRESS or Ray's record of the last one says.
            ray.init(address="local", include_dashboard=False, num_cpus=max(os.cpu_count() or 1, cpus_needed), **quiet)
            return True
        address = found
    if not address.startswith("ray://"):
        failure = answers(address)
        if failure is not None:
            raise RaySetupError(f"--ray {address}: no Ray cluster answers there ({failure}); give the head node's "
                                "HOST:PORT (its `ray start --head --port`)")
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RaySetupError(f"--ray {address}: could not join the Ray cluster there: {e}") from None
    return False


def this_machines_cluster(ray) -> str | None:
    """$RAY_ADDRESS, else the cluster Ray records as the last one started on this machine (what
    `ray.init(address="auto")` would join, which waits minutes on a record whose cluster is gone)."""
    try:
        return ray._private.services.canonicalize_bootstrap_address("auto")
    except (ConnectionError, ValueError):
        return None
    except AttributeError:          # a Ray without this helper: its own "auto", which may wait on a stale record
        return "auto"


def answers(address: str) -> str | None:
    """None if something accepts connections at HOST:PORT within 5 s, else why not."""
    if address == "auto":
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=5.0).close()
        return None
    except (OSError, ValueError) as e:
        return getattr(e, "strerror", None) or str(e)


@dataclass
class Placed:
    """One worker as the driver knows it: its actor, and the run of it the routers serve."""
    name: str
    role: Role
    actor: object
    info: dict | None = None
    lost_since: float | None = None       # its actor stopped answering (dead, restarting, its node gone)
    restarting: str | None = None         # the run id of a restart not serving yet
    died_errors: int = 0                  # ActorDiedError answers in a row
    given_up: bool = False


def worker_argv(cfg: LaunchConfig, name: str) -> list[str]:
    own = cfg.prefill_args if child_role(name) == Role.PREFILL else cfg.decode_args
    return ["--log-level", cfg.log_level, *cfg.worker_args, *own, *cfg.child_args.get(name, [])]


def shortage(ray, cfg: LaunchConfig, rcfg: RayConfig, threads: int) -> str:
    """Which resource the fleet needs more of than the cluster has (or that it is all in use)."""
    need: dict[str, float] = {"CPU": threads * (cfg.num_prefill + cfg.num_decode)}
    for count, resources in ((cfg.num_prefill, rcfg.prefill_resources), (cfg.num_decode, rcfg.decode_resources)):
        for name, amount in resources.items():
            need[name] = need.get(name, 0.0) + count * amount
    have = ray.cluster_resources()
    short = [f"{name}: the fleet needs {amount:g}, the cluster has {have.get(name, 0):g}"
             for name, amount in need.items() if have.get(name, 0) < amount]
    if short:
        return "; ".join(short)
    free = ray.available_resources()
    return ("the cluster has enough in all, but not free now or not together on one node (available: "
            + ", ".join(f"{k} {v:g}" for k, v in sorted(free.items()) if not k.startswith("node:")) + ")")


def place(ray, cfg: LaunchConfig, rcfg: RayConfig, secret: str, loopback: bool) -> list[Placed]:
    """Create every worker's actor and wait, bounded, until Ray has placed them all."""
    threads = cfg.threads or 1
    host = ray.remote(WorkerHost)
    placed = []
    for name in worker_names(cfg):
        role = child_role(name)
        resources = rcfg.prefill_resources if role == Role.PREFILL else rcfg.decode_resources
        actor = host.options(num_cpus=threads, resources=resources or None, max_restarts=cfg.max_restarts,
                             max_concurrency=4).remote(name, role, worker_argv(cfg, name), secret, threads, loopback)
        placed.append(Placed(name, role, actor))
    pending = {p.actor.info.remote(): p for p in placed}
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=rcfg.placement_timeout)
    if len(ready) < len(pending):
        waiting = [pending[ref].name for ref in pending if ref not in ready]
        raise RaySetupError(f"the cluster did not place {', '.join(waiting)} within {rcfg.placement_timeout:g} s: "
                            f"{shortage(ray, cfg, rcfg, threads)}")
    for ref in ready:
        pending[ref].info = ray.get(ref)
    return placed


def wait_serving(ray, placed: list[Placed], timeout: float) -> None:
    """Every worker's /health answers, and every node reaches the others' addresses."""
    try:
        infos = ray.get([p.actor.ready.remote(timeout) for p in placed], timeout=timeout + 10)
    except (TimeoutError, ray.exceptions.RayError) as e:
        raise RaySetupError(f"a worker did not start: {e}") from None
    for p, info in zip(placed, infos):
        p.info = info
        print(f"kvhandoff up: {p.name} serves at {info['url']} (node {info['node_ip']}, pid {info['pid']})", flush=True)
    for p in placed:
        others = [q.info["url"] for q in placed if q.role != p.role]
        failed = ray.get(p.actor.unreachable.remote(others))
        if failed:
            raise RaySetupError(f"{p.name} on node {p.info['node_ip']} cannot reach {', '.join(failed)}: the nodes' "
                                "addresses must reach each other for KV (routes, firewalls, ray start "
                                "--node-ip-address)")


class Follower:
    """Keeps every router's pool to what Ray runs: a restarted worker's new address in (once it
    serves), the old one drained. Never blocks on an actor: each question is answered in a later step."""

    def __init__(self, ray, placed: list[Placed], routers, secret: str):
        self.ray, self.placed, self.routers = ray, placed, routers
        self.client = httpx.Client(timeout=5.0, headers=control_headers(secret))
        self.asked: dict = {}                         # ref -> (Placed, "info" | "ready")

    def step(self, now: float, wait_s: float) -> None:
        busy = {p.name for p, _ in self.asked.values()}
        for p in self.placed:
            if not p.given_up and p.name not in busy:
                self.asked[p.actor.info.remote()] = (p, "info")
        if not self.asked:
            return
        done, _ = self.ray.wait(list(self.asked), num_returns=len(self.asked), timeout=wait_s)
        for ref in done:
            p, question = self.asked.pop(ref)
            try:
                answer = self.ray.get(ref)
            except self.ray.exceptions.ActorDiedError:
                # Also what a call in flight when its actor died gets, restarts left or not: only
                # several in a row mean Ray gave it up.
                p.died_errors += 1
                self.lost(p, now, gone_for_good=p.died_errors >= GIVE_UP_AFTER_DIED_ERRORS)
                continue
            except (self.ray.exceptions.RayActorError, TimeoutError) as e:
                p.died_errors = 0
                self.lost(p, now, gone_for_good=False, why=str(e).splitlines()[0].split(". ")[0][:200])
                continue
            p.died_errors = 0
            if question == "ready":
                self.serving_again(p, answer)
            elif answer["run_id"] != p.info["run_id"] and answer["run_id"] != p.restarting:
                p.restarting = answer["run_id"]
                print(f"kvhandoff up: Ray restarted {p.name} at {answer['url']} (node {answer['node_ip']}, pid "
                      f"{answer['pid']}); waiting for it to serve", flush=True)
                self.asked[p.actor.ready.remote(RESTART_READY_S)] = (p, "ready")

    def lost(self, p: Placed, now: float, gone_for_good: bool, why: str = "") -> None:
        if p.lost_since is None:
            p.lost_since = now
            print(f"kvhandoff up: {p.name} ({p.info['url']}) is gone{f' ({why})' if why else ''}; Ray restarts "
                  "its actor if it can", flush=True)
        if gone_for_good:
            p.given_up = True
            print(f"kvhandoff up: Ray reports {p.name}'s actor dead and not restarting (its restarts used up, or "
                  "its node gone with nowhere else to place it); the others keep serving", flush=True)

    def serving_again(self, p: Placed, info: dict) -> None:
        old, p.info, p.restarting, p.lost_since = p.info, info, None, None
        for router in self.routers:
            if router.proc is None or router.proc.poll() is not None:
                continue
            try:
                self.client.post(router.url + "/admin/workers", json={"role": p.role, "url": info["url"],
                                                                       "instance": info["run_id"]})
                if old["url"] != info["url"]:
                    self.client.delete(router.url + "/admin/workers", params={"url": old["url"]})
            except httpx.HTTPError as e:
                print(f"kvhandoff up: could not tell {router.name} of {p.name}'s new address: {e}", flush=True)
        print(f"kvhandoff up: {p.name} is serving again at {info['url']} (node {info['node_ip']})", flush=True)

    def close(self) -> None:
        self.client.close()


def run(cfg: LaunchConfig, rcfg: RayConfig) -> int:
    if cfg.mode == COLOCATED:
        print("kvhandoff up: --ray places prefill and decode workers; colocated mode has none to place", flush=True)
        return 2
    secret = os.environ.get(SECRET_ENV) or secrets.token_hex(32)
    env = {**os.environ, SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"}
    ray, started_here, placed, routers, follower = None, False, [], [], None
    started = time.monotonic()

    def interrupt(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)        # SIGTERM stops the stack the way Ctrl-C does ...
    try:
        ray = import_ray()
        started_here = connect(ray, rcfg.address, (cfg.threads or 1) * (cfg.num_prefill + cfg.num_decode))
        for sig in (signal.SIGTERM, signal.SIGINT):  # ... also once ray.init has put its own in place
            signal.signal(sig, interrupt)
        nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
        print(f"kvhandoff up: on the Ray cluster of {len(nodes)} node(s) ({', '.join(nodes)})", flush=True)
        placed = place(ray, cfg, rcfg, secret, loopback=started_here)
        wait_serving(ray, placed, cfg.startup_timeout)
        urls = lambda role: [p.info["url"] for p in placed if p.role == role]
        routers = router_children(cfg, urls(Role.PREFILL), urls(Role.DECODE), cfg.port or free_port(cfg.host))
        for router in routers:
            spawn(router, env)
            print(f"kvhandoff up: started {router.describe()}", flush=True)
        follower = Follower(ray, placed, routers, secret)
        serve(cfg, placed, routers, follower, env, started)
    except KeyboardInterrupt:
        pass
    except (RaySetupError, TimeoutError, StackDown) as e:
        print(f"kvhandoff up: {e}; stopping everything", flush=True)
        return 1
    except ChildDied as e:
        print(f"kvhandoff up: {e}; stopping the others (its output is above, prefixed [{e.child.name}])", flush=True)
        return 1
    finally:
        stop(routers, cfg.stop_timeout)
        if follower is not None:
            follower.close()
        stop_workers(ray, placed, cfg.stop_timeout)
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        print("kvhandoff up: stopped" + (" (and the one-node Ray cluster it started)" if started_here else ""),
              flush=True)
    return 0


def stop_workers(ray, placed: list[Placed], timeout: float) -> None:
    """Each worker SIGTERMed by its actor (it ends its streams and frees its KV), then every actor
    killed for good; a worker whose actor does not answer (its node gone) dies with the actor."""
    alive = [p for p in placed if p.info is not None and p.lost_since is None and not p.given_up]
    if alive:
        ray.wait([p.actor.stop.remote() for p in alive], num_returns=len(alive), timeout=timeout)
    for p in placed:
        ray.kill(p.actor, no_restart=True)


def serve(cfg: LaunchConfig, placed: list[Placed], routers, follower: Follower, env: dict, started: float) -> None:
    """Until the stack must stop (Ctrl-C or SIGTERM: KeyboardInterrupt): follow Ray's workers, restart
    dead routers (if several)."""
    deadline, serving = time.monotonic() + cfg.startup_timeout, False
    with httpx.Client(timeout=2.0, headers=control_headers(env[SECRET_ENV])) as client:
        while True:
            now = time.monotonic()
            tend(routers, cfg, env, client, serving, now)
            if not serving:
                workers = [p.info["url"] for p in placed]
                if all(r.ready for r in routers) and router_sees_ready(routers, workers, client):
                    serving = True
                    front = front_url(cfg, routers)
                    print(f"kvhandoff up: on Ray in {time.monotonic() - started:.1f} s", flush=True)
                    print(f"kvhandoff: serving '{served_name(front)}' at {front}/v1 (mode {cfg.mode}, on Ray; health "
                          f"{front}/health, metrics {front}/metrics; Ctrl-C stops everything)", flush=True)
                elif now > deadline:
                    raise TimeoutError(f"the routers did not see every worker within {cfg.startup_timeout:.0f} s")
            interval = FOLLOW_INTERVAL_S if serving else 0.1
            follower.step(now, interval)
            for role in ROLES:
                if all(p.given_up for p in placed if p.role == role):
                    raise StackDown(f"no {role} worker is left on the cluster; nothing can be served")
            time.sleep(max(0.0, interval - (time.monotonic() - now)))
