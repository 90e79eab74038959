"""The `kvhandoff` command: one subcommand per role (serve, router, up; bench, demo later).

Each subcommand is a `cmd_*` function registered in `build_parser`; heavy imports (torch, the engine,
uvicorn) happen inside them so `kvhandoff --help` stays instant. Listeners bind loopback unless told
otherwise: a server that runs arbitrary prompts should not be reachable from the network by accident.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

from kvhandoff.config import EngineConfig, ModelNotFound
from kvhandoff.wire import modes
from kvhandoff.wire.auth import OPEN_PATHS
from kvhandoff.wire.cost import ReusePolicy
from kvhandoff.wire.modes import COLOCATED, ROLES, DecodePolicy, FailurePolicy, Mode, PrefillPolicy, Role

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DECODE_POLICIES = tuple(p.value for p in DecodePolicy)
PREFILL_POLICIES = tuple(p.value for p in PrefillPolicy)
REUSE_POLICIES = tuple(p.value for p in ReusePolicy)
FAILURE_POLICIES = tuple(p.value for p in FailurePolicy)
# transfer.agent.BACKENDS, spelled out so that a router's process never loads the transfer layer (a
# test keeps them equal).
KV_BACKENDS = ("auto", "shm", "tcp", "nixl")


def add_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-policy", default=DecodePolicy.FEWEST.value, choices=DECODE_POLICIES,
                   help="how the router picks a decode worker: fewest-in-flight (this router's requests on it), "
                        "round-robin, or load (its reported step time x the sequences it will step with); "
                        "docs in kvhandoff/router/policies.py (default: %(default)s)")
    p.add_argument("--prefill-policy", default=PrefillPolicy.FEWEST.value, choices=PREFILL_POLICIES,
                   help="how the router picks a prefill worker: fewest-in-flight, or cache-aware (the longest "
                        "prefix it should have cached, weighed against its queued tokens) (default: %(default)s)")
    p.add_argument("--disagg-min-tokens", type=int, default=0, metavar="N",
                   help="selective disaggregation: a prompt with fewer than N tokens uncached on the best prefill "
                        "worker is computed on a decode worker, with no handoff (default: %(default)s = never)")
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between the router's /health polls of its workers, what the load-aware policies "
                        "and late binding read; 0 = off (default: %(default)s)")
    p.add_argument("--late-binding", action="store_true",
                   help="push modes: the decode worker picked at arrival may be replaced while the prompt is "
                        "still computed, if it has fallen behind (its expected wait over 1.5x the best other's); "
                        "the registration is withdrawn and made again there")
    p.add_argument("--migration-limit", type=int, default=1, metavar="N",
                   help="a stream whose decode worker fails (dies, breaks off, errs) after the client has tokens "
                        "continues on another decode worker from the tokens sent, at most N times; 0 = never: it "
                        "ends with an error event (default: %(default)s)")
    p.add_argument("--http-legs", action="store_true",
                   help="send every leg to the workers as an HTTP request, not over the persistent channel each "
                        "of ours offers in its /health (kvhandoff/wire/channel.py): to compare, or across a proxy "
                        "that passes only HTTP")
    p.add_argument("--forget-joined-after-s", type=float, default=30.0, metavar="S",
                   help="a worker that joined by itself (serve --join) and has not answered a health poll for S "
                        "seconds is drained from the pool; it joins again if it comes back (default: %(default)s)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine knobs, shared by every subcommand that runs an engine; defaults come from EngineConfig."""
    d = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=d["model"],
                   help="'smollm2', 'tiny' (random, for tests), or a path to an HF folder or .gguf file "
                        "(default: %(default)s)")
    g.add_argument("--dtype", default=d["dtype"], choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype; auto picks per device (default: %(default)s)")
    g.add_argument("--device", default=d["device"], choices=["auto", "cpu", "cuda"], help="(default: %(default)s)")
    g.add_argument("--block-size", type=int, default=d["block_size"], help="tokens per KV block (default: %(default)s)")
    g.add_argument("--num-blocks", type=int, default=d["num_blocks"],
                   help="KV blocks in the pool; 0 sizes the pool from --kv-cache-mb (default: %(default)s)")
    g.add_argument("--kv-cache-mb", type=int, default=d["kv_cache_bytes"] // 2**20,
                   help="KV pool size in MiB when --num-blocks is 0 (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                   help="sequences running per step (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"],
                   help="tokens per step; longer prompts are prefilled in chunks (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=d["max_model_len"],
                   help="context limit; 0 uses the model's (default: %(default)s)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--threads", type=int, default=d["threads"],
                   help="threads the engine computes with; 0: torch's default, every core this process may "
                        "use. Workers that share cores should take 1 each (kvhandoff up gives each the cores it "
                        "owns): a team of threads spins while its engine computes (default: %(default)s)")
    g.add_argument("--seed", type=int, default=d["seed"], help="(default: %(default)s)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_blocks=args.num_blocks, kv_cache_bytes=args.kv_cache_mb * 2**20, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, threads=args.threads, seed=args.seed)


def add_http_args(p: argparse.ArgumentParser, port: int) -> None:
    g = p.add_argument_group("http")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind; loopback by default, pass 0.0.0.0 to expose it (default: %(default)s)")
    g.add_argument("--port", type=int, default=port, help="0 picks a free port (default: %(default)s)")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: %(default)s)")
    g.add_argument("--api-key", default=None,
                   help="clients must send 'Authorization: Bearer KEY' (prefer $KVHANDOFF_API_KEY: command lines "
                        "are visible to other users) (default: no client authentication)")
    g.add_argument("--api-key-open-paths", default=OPEN_PATHS, metavar="PATHS",
                   help="paths served without the API key; '' requires it everywhere (default: %(default)s)")


def guard(app, args: argparse.Namespace, secret: bytes | None, who: str) -> bool:
    """Put the API key (if any) in front of `app`; whether there is one."""
    from kvhandoff.wire.auth import ClientKeyGate, parse_open_paths, resolve_api_key
    key = resolve_api_key(args.api_key)
    if not key:
        return False
    try:
        open_paths = parse_open_paths(args.api_key_open_paths)
    except ValueError as e:
        raise SystemExit(f"kvhandoff {who}: --api-key-open-paths: {e}") from None
    app.add_middleware(ClientKeyGate, api_key=key, secret=secret, open_paths=open_paths)
    logging.getLogger("kvhandoff.cli").info("clients need the API key on every path but %s",
                                            ", ".join(sorted(open_paths)) or "none")
    return True


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """`kvhandoff serve`'s handoff flags, a group per side they concern."""
    g = p.add_argument_group("disaggregation (docs/HANDOFF.md)")
    g.add_argument("--role", type=Role, default=Role.BOTH, choices=[Role.BOTH, *ROLES],
                   help="both: colocated; prefill/decode: one side of a handoff (default: %(default)s)")
    g.add_argument("--kv-secret", default=None,
                   help="deployment secret shared with the router and peers (prefer $KVHANDOFF_SECRET: "
                        "command lines are visible to other users)")
    g.add_argument("--kv-backend", default="auto", choices=KV_BACKENDS,
                   help="KV transfer backend; auto: shm with same-host peers, tcp otherwise (default: %(default)s)")
    g.add_argument("--kv-host", default=None, help="address the KV agent listens on (default: --host)")
    g.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="do not publish what this worker holds (KV events, docs/HANDOFF.md): routers then ask it "
                        "on each request's path instead")
    g.add_argument("--kv-shm-dir", default="/dev/shm",
                   help="where the shared-memory KV pool lives; a tmpfs mounted with huge=within_size "
                        "makes same-host copies ~2x faster here (default: %(default)s)")
    g.add_argument("--kv-timeout-s", type=float, default=30.0,
                   help="push: seconds either side waits for the other (default: %(default)s)")
    g = p.add_argument_group("prefill side")
    g.add_argument("--lease-s", type=float, default=30.0,
                   help="pull: seconds prefill keeps a prompt's KV for the decode side (default: %(default)s)")
    g = p.add_argument_group("decode side")
    g.add_argument("--kv-load-failure-policy", default="recompute", choices=FAILURE_POLICIES,
                   help="when KV cannot be loaded or fails verification (default: %(default)s)")
    add_bidirectional_worker_args(p)
    g = p.add_argument_group("testing")
    g.add_argument("--inject-faults", default=None, metavar="SPEC",
                   help="TESTING ONLY: make this worker's transfers fail or slow, its notifications vanish, or "
                        "kill it at a phase, e.g. read_fail, write_fail, slow_ms=300, drop=done+release, "
                        "delay_ms=500, step_ms=200, verify_ms=1000, kill_at=registered|transfer|decode "
                        "(kvhandoff/worker/faults.py)")


def add_bidirectional_worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bidirectional multi-turn reuse (with the router's --bidirectional)")
    g.add_argument("--bidirectional", action="store_true",
                   help="decode: keep each finished turn's KV for the conversation's next turn; prefill: read "
                        "it back instead of recomputing the history when that is cheaper")
    g.add_argument("--retention-ttl", type=float, default=480.0,
                   help="decode: seconds a finished turn's KV is kept (default: %(default)s)")
    g.add_argument("--retention-max-bytes", type=parse_bytes, default=None, metavar="BYTES",
                   help="decode: cap on retained KV, e.g. 256M (least recently used evicted first; running "
                        "requests always evict retained KV when they need blocks) (default: no cap of its own)")
    g.add_argument("--reuse-min-tokens", type=int, default=64,
                   help="prefill: never fetch fewer tokens than this (those its own prefix cache lacks) (default: %(default)s)")
    g.add_argument("--reuse-policy", default="cost", choices=REUSE_POLICIES,
                   help="prefill: fetch only when the cost model says it beats recomputing, or whenever above "
                        "the floor (default: %(default)s)")


def parse_bytes(spec: str) -> int:
    """'268435456', '256M', '1.5G' -> bytes (binary multiples)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
    text = spec.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] in "KMG" else ""
    try:
        value = float(text[:len(text) - len(unit)]) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {spec!r} (e.g. 268435456, 256M, 1G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size cannot be negative: {spec!r}")
    return int(value)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_serve(args: argparse.Namespace) -> int:
    """One worker: engine + OpenAI-compatible HTTP server, and the handoff of a prefill or decode role."""
    setup_logging(args.log_level)
    log = logging.getLogger("kvhandoff.cli")
    log.debug("serve options: %s", {k: v for k, v in vars(args).items() if k not in ("kv_secret", "func")})
    from kvhandoff.wire.http import serve_forever
    from kvhandoff.worker.app import WorkerSetupError, build_worker

    config = worker_config(args)
    routers = join_targets(args)
    membership = None
    if config.handoff.faults.any:
        log.warning("FAULT INJECTION ENABLED (%s): this worker will fail on purpose", args.inject_faults)
    try:
        worker = build_worker(config)
    except WorkerSetupError as e:
        raise SystemExit(f"kvhandoff serve: {e}") from None
    worker.loop.on_fatal = stop_after_engine_failure
    try:
        if not guard(worker.app, args, config.secret, "serve") and args.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("binding %s: the server is reachable from other machines and has no client "
                        "authentication (--api-key)", args.host)
        worker.start()

        def ready(url: str) -> None:
            nonlocal membership
            print(f"kvhandoff: serving '{worker.loop.engine.served_name}' at {url}/v1 "
                  f"(health {url}/health, metrics {url}/metrics)", flush=True)
            if routers:
                from urllib.parse import urlsplit

                from kvhandoff.worker.membership import Membership, advertised_url
                bound = urlsplit(url).port
                membership = Membership(routers, args.role, advertised_url(args.host, bound, args.advertise_url),
                                        config.secret)
                membership.start()
        serve_forever(worker.app, args.host, args.port, log_level=args.log_level, on_ready=ready,
                      channel_secret=config.secret)
    except KeyboardInterrupt:
        pass
    finally:
        if membership is not None:
            membership.leave()
        worker.close()
        log.info("engine stopped")
        if worker.loop.fatal_error:            # (replaces the SystemExit(0) its SIGTERM became)
            raise SystemExit(1)
    return 0


def worker_config(args: argparse.Namespace):
    """`kvhandoff serve`'s flags as a WorkerConfig, checked: a mistake is a message before anything starts."""
    from kvhandoff.wire.auth import SECRET_ENV, resolve_secret
    from kvhandoff.wire.cost import ReuseConfig
    from kvhandoff.worker.app import WorkerConfig
    from kvhandoff.worker.config import HandoffConfig, RetentionConfig
    from kvhandoff.worker.faults import Faults
    try:
        faults = Faults.parse(args.inject_faults)
    except ValueError as exc:
        raise SystemExit(f"kvhandoff serve: --inject-faults: {exc}") from None
    # A colocated server needs no secret; with one (under `kvhandoff up`), its API key gate also lets
    # the launcher's health polls through.
    secret = resolve_secret(args.kv_secret)
    if args.role == Role.BOTH:
        # A colocated server has no handoff to fault: only its engine's faults mean anything there, and a
        # fault that would be silently ignored is refused instead.
        if faults != Faults(step_ms=faults.step_ms, engine_fail=faults.engine_fail):
            raise SystemExit("kvhandoff serve: --inject-faults: a colocated server (--role both) takes only "
                             "step_ms=N and engine_fail")
    else:
        # A worker's KV pool is a host shared-memory tensor its peers copy from; a pool on the GPU with
        # transfers staged through pinned host memory is not built (nor tested on a GPU machine).
        if args.device == "cuda":
            raise SystemExit(f"kvhandoff serve: --role {args.role} runs on the CPU only: its KV pool is host "
                             "shared memory that peers copy from, and a GPU-resident pool is not supported yet; "
                             "use --device cpu, or serve on the GPU colocated (--role both)")
        args.device = "cpu"     # auto: never a GPU here, whatever the machine has (see above)
        if not secret:
            raise SystemExit(f"--role {args.role} needs the deployment secret: --kv-secret or ${SECRET_ENV}")
    handoff = HandoffConfig(args.lease_s, args.kv_timeout_s, args.kv_load_failure_policy,
                            bidirectional=args.bidirectional,
                            retention=RetentionConfig(args.retention_ttl, args.retention_max_bytes),
                            reuse=ReuseConfig(args.reuse_min_tokens, args.reuse_policy), faults=faults)
    return WorkerConfig(role=args.role, engine=engine_config(args), host=args.host, port=args.port, secret=secret,
                        kv_host=args.kv_host, kv_backend=args.kv_backend, kv_shm_dir=args.kv_shm_dir,
                        handoff=handoff, kv_events=args.kv_events,
                        max_in_flight=args.max_in_flight if args.max_in_flight > 0 else None,
                        queue_wait_s=args.queue_wait_s, model_alias=args.model)


def join_targets(args: argparse.Namespace) -> list[str]:
    """The routers `--join` names (checked before anything starts: a mistake is a message, not a worker
    that serves nobody)."""
    if not args.join:
        if args.advertise_url:
            raise SystemExit("kvhandoff serve: --advertise-url is for --join")
        return []
    from kvhandoff.router.pool import parse_urls
    from kvhandoff.worker.membership import advertised_url
    if args.role == Role.BOTH:
        raise SystemExit("kvhandoff serve: --join is for --role prefill or decode (a router's pool holds those)")
    try:
        routers = parse_urls(args.join)
        advertised_url(args.host, args.port, args.advertise_url)
    except ValueError as e:
        raise SystemExit(f"kvhandoff serve: --join: {e}") from None
    return routers


def stop_after_engine_failure(error: str) -> None:
    """The engine loop died of a bug: every request it had was failed with `error`. Stop the worker
    the way SIGTERM does (its KV pool unlinked, its port closed) and exit 1, so that `kvhandoff up`
    (or any supervisor) starts a fresh one; kept alive it could only answer 503."""
    logging.getLogger("kvhandoff.cli").critical("%s; stopping this worker so that its supervisor can start a "
                                                "fresh one", error)
    os.kill(os.getpid(), signal.SIGTERM)


def cmd_router(args: argparse.Namespace) -> int:
    """The OpenAI-compatible front of a disaggregated deployment: sequences prefill and decode workers."""
    setup_logging(args.log_level)
    from kvhandoff.router import RouterConfig, build_router_app, parse_urls
    from kvhandoff.wire.auth import SECRET_ENV, resolve_secret
    from kvhandoff.wire.http import serve_forever

    secret = resolve_secret(args.kv_secret)
    if not secret:
        raise SystemExit(f"kvhandoff router: no deployment secret; set {SECRET_ENV} (or --kv-secret) to the "
                         "secret its workers were started with")
    try:
        config = RouterConfig(prefill_urls=parse_urls(args.prefill), decode_urls=parse_urls(args.decode),
                              mode=args.mode, secret=secret, request_timeout=args.request_timeout,
                              health_interval=args.health_interval, retry_colocated=args.retry_colocated,
                              bidirectional=args.bidirectional, decode_policy=args.decode_policy,
                              prefill_policy=args.prefill_policy, disagg_min_tokens=args.disagg_min_tokens,
                              late_binding=args.late_binding, migration_limit=args.migration_limit,
                              forget_joined_after_s=args.forget_joined_after_s, worker_channels=not args.http_legs,
                              shared_sessions=args.shared_sessions, engine=args.engine,
                              retention_ttl=args.retention_ttl)
    except ValueError as e:
        raise SystemExit(f"kvhandoff router: {e}")
    app = build_router_app(config)
    if not guard(app, args, secret, "router") and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("kvhandoff.cli").warning(
            "binding %s: the router is reachable from other machines and has no client authentication (--api-key)",
            args.host)

    def ready(url: str) -> None:
        front = f" and the shared front port {args.front_port}" if args.front_port is not None else ""
        print(f"kvhandoff: router ({args.mode}; prefill {','.join(config.prefill_urls)}; decode "
              f"{','.join(config.decode_urls)}) at {url}/v1{front} (health {url}/health, metrics {url}/metrics)",
              flush=True)
    try:
        serve_forever(app, args.host, args.port, log_level=args.log_level, on_ready=ready, shared_port=args.front_port)
    except KeyboardInterrupt:
        pass
    except OSError as e:
        raise SystemExit(f"kvhandoff router: {e}") from None
    return 0


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags the user changed, as words for a worker's command line (threads excepted:
    the launcher sets them per worker)."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    argv = []
    for action in p._actions:
        value = getattr(args, action.dest)
        if action.dest == "threads" or value == action.default:
            continue
        argv += [action.option_strings[0]] if action.nargs == 0 else [action.option_strings[0], str(value)]
    return argv


def parse_cores(spec: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5] (the cpuset list syntax of taskset and /sys)."""
    cores = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a core list: {spec!r} (e.g. 0 or 0-3 or 0,2)") from None
    if not cores:
        raise argparse.ArgumentTypeError(f"no core in {spec!r}")
    return sorted(cores)


def cmd_up(args: argparse.Namespace) -> int:
    """Workers and router on this machine in one command; Ctrl-C stops them all. Unknown flags are
    passed to every worker."""
    from kvhandoff.launch.netlink import LinkSpec
    from kvhandoff.launch.supervisor import LaunchConfig, run

    if args.late_binding and not (args.mode != COLOCATED and Mode(args.mode).is_push):
        raise SystemExit(f"kvhandoff up: --late-binding is for the push modes, not {args.mode}")
    from kvhandoff.wire.auth import API_KEY_ENV, parse_open_paths
    try:
        parse_open_paths(args.api_key_open_paths)
    except ValueError as e:
        raise SystemExit(f"kvhandoff up: --api-key-open-paths: {e}") from None
    if args.api_key:     # to every child through the environment, never on a command line `ps` shows
        os.environ[API_KEY_ENV] = args.api_key
    key_args = [] if args.api_key_open_paths == OPEN_PATHS else ["--api-key-open-paths", args.api_key_open_paths]
    worker_args = engine_argv(args) + args.extra + (["--bidirectional"] if args.bidirectional else []) + key_args
    if args.retention_ttl is not None and args.engine != modes.Engine.VLLM:
        worker_args += ["--retention-ttl", str(args.retention_ttl)]
    vllm = None
    if args.engine == modes.Engine.VLLM:
        vllm = vllm_launch(args)
    elif args.vllm_python or args.vllm_args or args.vllm_stock:
        raise SystemExit("kvhandoff up: --vllm-python, --vllm-args and --vllm-stock are for --engine vllm")
    if args.extra:
        print(f"kvhandoff up: passing {' '.join(args.extra)} to every worker", flush=True)
    try:
        link = LinkSpec.parse(args.link) if args.link else None
        router_args = (["--retry-colocated"] if args.retry_colocated else []) + \
                      (["--bidirectional"] if args.bidirectional else []) + \
                      (["--late-binding"] if args.late_binding else []) + \
                      (["--http-legs"] if args.http_legs else []) + \
                      ["--decode-policy", args.decode_policy, "--prefill-policy", args.prefill_policy,
                       "--disagg-min-tokens", str(args.disagg_min_tokens), "--health-interval", str(args.health_interval),
                       "--migration-limit", str(args.migration_limit),
                       "--forget-joined-after-s", str(args.forget_joined_after_s)] + key_args
        cfg = LaunchConfig(mode=args.mode, worker_args=worker_args, router_args=router_args,
                           prefill_args=shlex.split(args.prefill_args), decode_args=shlex.split(args.decode_args),
                           num_prefill=args.prefill, num_decode=args.decode, num_routers=args.routers,
                           router_cores=args.router_cores,
                           host=args.host, port=args.port, threads=args.threads, cores=args.cores,
                           log_level=args.log_level, startup_timeout=args.startup_timeout,
                           max_restarts=args.max_restarts, child_args=parse_child_args(args.worker_args),
                           link=link, vllm=vllm)
    except ValueError as e:
        raise SystemExit(f"kvhandoff up: {e}") from None
    if vllm is not None and args.ray is not None:
        raise SystemExit("kvhandoff up: --engine vllm runs on this machine; --ray places our own workers")
    if args.ray is None:
        if args.prefill_resources or args.decode_resources:
            raise SystemExit("kvhandoff up: --prefill-resources and --decode-resources are for --ray")
        return run(cfg)
    from kvhandoff.launch import ray_fleet
    if link is not None or args.cores is not None:
        raise SystemExit(f"kvhandoff up: --ray places the workers on the cluster's nodes: {'--link' if link else '--cores'} "
                         "is for one machine (Ray gives each worker --threads CPUs)")
    try:
        rcfg = ray_fleet.RayConfig(address=args.ray, placement_timeout=args.placement_timeout,
                                   prefill_resources=ray_fleet.parse_resources(args.prefill_resources),
                                   decode_resources=ray_fleet.parse_resources(args.decode_resources))
    except ValueError as e:
        raise SystemExit(f"kvhandoff up: {e}") from None
    return ray_fleet.run(cfg, rcfg)


def vllm_launch(args: argparse.Namespace):
    """`up --engine vllm`: what to start vLLM with, checked (its interpreter, vLLM and NIXL in it, the mode,
    the model) before anything starts; a message, not a traceback, for what is wrong."""
    from kvhandoff.launch.vllm import VllmLaunch
    if not args.vllm_python:
        raise SystemExit("kvhandoff up --engine vllm: needs --vllm-python, the interpreter vLLM is installed in "
                         "(docs/VLLM.md)")
    if args.extra:
        raise SystemExit(f"kvhandoff up --engine vllm: {' '.join(args.extra)} would go to our workers; give vLLM's "
                         "servers their flags with --vllm-args")
    from kvhandoff.wire.vllm import refusal
    why = refusal(args.mode, args.bidirectional, args.late_binding, args.prefill_policy == "cache-aware",
                  args.disagg_min_tokens)
    if why is not None:
        raise SystemExit(f"kvhandoff up --engine vllm: {why}")
    launch = VllmLaunch(args.vllm_python, args.model, bidirectional=args.bidirectional,
                        retention_ttl=480.0 if args.retention_ttl is None else args.retention_ttl, dtype=args.dtype,
                        args=shlex.split(args.vllm_args), stock=args.vllm_stock, placement=args.vllm_placement)
    try:
        launch.prepare(args.mode)
    except ValueError as e:
        raise SystemExit(f"kvhandoff up --engine vllm: {e}") from None
    return launch


def parse_child_args(specs: list[str]) -> dict[str, list[str]]:
    """--worker-args decode-1="--inject-faults step_ms=50" (repeatable) -> {"decode-1": [...]}."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--worker-args {spec!r}: expected NAME=FLAGS, e.g. decode-1=--no-prefix-caching")
        out.setdefault(name.strip(), []).extend(shlex.split(flags))
    return out


def cmd_workers(args: argparse.Namespace) -> int:
    """List, add or remove a router's workers at run time (its /admin/workers, with the deployment
    secret from $KVHANDOFF_SECRET or --kv-secret). A removed worker is drained: it finishes what it
    has and gets nothing new."""
    import httpx

    from kvhandoff.wire.auth import SECRET_ENV, control_headers, resolve_secret

    secret = resolve_secret(args.kv_secret)
    if not secret:
        raise SystemExit(f"kvhandoff workers: no deployment secret; set {SECRET_ENV} (or --kv-secret)")
    url, headers = args.router.rstrip("/").removesuffix("/v1") + "/admin/workers", control_headers(secret)
    try:
        if args.action == "list":
            resp = httpx.get(url, headers=headers, timeout=10)
        elif args.action == "add":
            if not args.role or not args.url:
                raise SystemExit("kvhandoff workers add: needs --role and --url")
            resp = httpx.post(url, headers=headers, json={"role": args.role, "url": args.url}, timeout=30)
        else:
            if not args.url:
                raise SystemExit("kvhandoff workers remove: needs --url")
            resp = httpx.delete(url, headers=headers, params={"url": args.url}, timeout=10)
    except httpx.HTTPError as e:
        raise SystemExit(f"kvhandoff workers: {url}: {e}") from None
    print(resp.text)
    return 0 if resp.status_code == 200 else 1


def cmd_bench(args: argparse.Namespace) -> int:
    """Measure an OpenAI-compatible endpoint (--target) or our own stacks (--launch) under a workload:
    TTFT, TPOT, inter-token latency, end to end, goodput, and the handoff phases when the server
    reports them. Talks HTTP only."""
    from kvhandoff.bench.command import main

    if args.launch is not None:
        from kvhandoff.bench.command import launch_spec
        args.launch = [m.strip() for m in args.launch.split(",") if m.strip()]
        up_flags = argparse.ArgumentParser(prog="kvhandoff bench --launch", add_help=False)   # values checked now
        add_policy_args(up_flags)
        for flag in ("--bidirectional", "--retry-colocated", "--no-prefix-caching"):
            up_flags.add_argument(flag, action="store_true")
        up_flags.add_argument("--reuse-policy", choices=REUSE_POLICIES)
        up_flags.add_argument("--link", type=link_rate)
        up_flags.add_argument("--retention-ttl", type=positive_float)
        try:
            for spec in args.launch:
                up_flags.parse_args(launch_spec(spec)[1])
        except ValueError as exc:
            raise SystemExit(f"kvhandoff bench: {exc}") from None
        if not args.launch:
            raise SystemExit("kvhandoff bench: --launch needs at least one mode")
        # Grid rates are fractions of the colocated capacity, measured on the first stack: colocated first.
        args.launch.sort(key=lambda m: m != "colocated")
    args.rates = [float(x) for x in args.rates.split(",") if x.strip()]
    if not args.rates or any(r <= 0 for r in args.rates):
        raise SystemExit("kvhandoff bench: --rates must be positive fractions of capacity, e.g. 0.25,0.5,0.75,0.9")
    args.launch_args = shlex.split(args.launch_args)
    if args.workload in ("grid", "binding") and args.longest is not None and (args.shortest or 16) > args.longest:
        raise SystemExit("kvhandoff bench: --shortest must not exceed --longest")
    return main(args)


# The demo's sizes per model: (shortest, longest, output tokens, requests per rate) for the grid and
# (new tokens per turn, answer tokens) for the conversations. SmolLM2's took 3.2 minutes on a 2-core
# Zen 5 (bf16) and 19 on an AVX2-only EPYC (fp32): to be sized from a calibration (issue 14).
def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def link_rate(text: str) -> str:
    from kvhandoff.launch.netlink import LinkSpec
    try:
        LinkSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def demo_link(text: str) -> str:
    """The demo's --link: auto, none, or a rate alone (link_rate)."""
    if text in ("auto", "none"):
        return text
    if "," in text:
        raise argparse.ArgumentTypeError("the demo's --link takes a rate only, e.g. 200mbit")
    return link_rate(text)


def cmd_demo(args: argparse.Namespace) -> int:
    """The whole story on this machine in about --minutes: a short calibration sizes everything; isolated
    requests per mode (colocated on one core, pull, push, push-layerwise), over the free link and behind
    an emulated slow link sized so that moving a prompt's KV costs most of its prefill, with each
    request's phases; then multi-turn conversations with and without bidirectional reuse. Prints the
    tables and where they and the plots are (kvhandoff/bench/demo.py says how it sizes)."""
    import time

    from kvhandoff.bench import demo

    if args.engine == modes.Engine.VLLM:
        return demo_vllm(args)
    started = time.monotonic()
    budget_s = args.minutes * 60
    clock = lambda: f"{(time.monotonic() - started) / 60:.1f} min"
    print(f"kvhandoff demo: calibration and isolated requests per mode ({args.model}; budget {args.minutes:g} min)",
          flush=True)
    cal = demo.isolated_part(args.model, args.out / "isolated", budget_s, started, args.link)
    new_tokens, answer = demo.plan_multiturn(cal, budget_s - (time.monotonic() - started))
    print(f"kvhandoff demo: multiturn ({args.model}; {demo.CONVERSATIONS} conversations of {demo.TURNS} turns, "
          f"{new_tokens} new tokens and {answer}-token answers a turn; at {clock()})", flush=True)
    argv = ["--launch", f"{Mode.PUSH},{Mode.PUSH}+bidirectional", "--workload", "multiturn",
            "--conversations", str(demo.CONVERSATIONS), "--turns", str(demo.TURNS), "--new-tokens", str(new_tokens),
            "--answer-tokens", str(answer), "--think-s", str(demo.THINK_S),
            "--launch-args=--prefill-args=--no-prefix-caching"]
    bench_args = build_parser().parse_args(["bench", "--model", args.model, "--out", str(args.out / "multiturn"), *argv])
    bench_args.extra = []
    rc = cmd_bench(bench_args)
    if rc:
        return rc
    plots = sorted(str(p) for p in args.out.glob("*/*.png"))
    print(f"kvhandoff demo: done in {clock()}. Tables: {args.out / 'isolated' / 'summary.txt'}, "
          f"{args.out / 'multiturn' / 'summary.md'}\nPlots: " + ", ".join(plots), flush=True)
    return 0


def demo_vllm(args: argparse.Namespace) -> int:
    """`demo --engine vllm`: the same story on vLLM workers behind our router (docs/VLLM.md): isolated
    1,024-token requests on vLLM colocated, pull (beside vllm-router, when it is installed) and push
    (kvhandoff.bench.vllm), then multi-turn conversations through pull with and without bidirectional
    reuse. Not sized by --minutes: each vLLM stack takes about a minute to start."""
    import shutil

    from kvhandoff.bench import demo
    if not args.vllm_python:
        raise SystemExit("kvhandoff demo --engine vllm: needs --vllm-python (docs/VLLM.md)")
    from kvhandoff.bench import vllm as bench_vllm
    print("kvhandoff demo: vLLM workers, isolated requests (colocated, pull, push)", flush=True)
    modes_run = "colocated,pull,push" if shutil.which(str(Path(args.vllm_python).with_name("vllm-router"))) \
        else "colocated,push"
    rc = bench_vllm.main(["--vllm-python", args.vllm_python, "--model", args.model, "--requests", "3",
                          "--modes", modes_run, "--vllm-args=--enforce-eager", "--out", str(args.out / "isolated")])
    if rc:
        return rc
    print("kvhandoff demo: vLLM workers, multi-turn with and without bidirectional reuse", flush=True)
    launch = f"--engine vllm --vllm-python {shlex.quote(args.vllm_python)} --vllm-args=--enforce-eager"
    bench_args = build_parser().parse_args([
        "bench", "--model", args.model, "--out", str(args.out / "multiturn"), "--launch", "pull,pull+bidirectional",
        "--workload", "multiturn", "--conversations", str(demo.CONVERSATIONS), "--turns",
        str(demo.TURNS), "--new-tokens", "200", "--answer-tokens", "32", "--think-s", "1",
        f"--launch-args={launch}"])
    bench_args.extra = []
    return cmd_bench(bench_args)


def cmd_simulate(args: argparse.Namespace) -> int:
    """A calibrated model of a disaggregated fleet: fitted on a `kvhandoff bench` run, shown to reproduce
    it, then run on fleets and rates this machine cannot host (kvhandoff/sim/command.py)."""
    from kvhandoff.sim.command import main
    return main(args)


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    """Data-plane throughput and latency per backend, next to memcpy and a raw loopback sendmsg stream."""
    import json

    from kvhandoff.transfer.bench import BenchConfig, format_table, run

    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = set(backends) - {"shm", "tcp", "nixl"}
    if unknown:
        raise SystemExit(f"unknown backend(s): {', '.join(sorted(unknown))} (choose from shm, tcp, nixl)")
    report = run(BenchConfig(backends=backends, total_bytes=args.total_mb * 2**20, repeats=args.repeats,
                             latency_iters=args.latency_iters, pin=args.pin, shm_dir=args.shm_dir))
    print(format_table(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvhandoff", description="Disaggregated LLM serving with KV handoff.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_command(sub)
    add_router_command(sub)
    add_up_command(sub)
    add_workers_command(sub)
    add_bench_command(sub)
    add_demo_command(sub)
    add_simulate_command(sub)
    add_bench_transfer_command(sub)
    return parser


def add_serve_command(sub) -> None:
    p = sub.add_parser("serve", help="run one worker (colocated, prefill or decode) behind an OpenAI-compatible API",
                       description=cmd_serve.__doc__)
    add_engine_args(p)
    add_http_args(p, port=8000)
    add_worker_args(p)
    g = p.add_argument_group("backpressure")
    g.add_argument("--max-in-flight", type=int, default=256,
                   help="requests held at once, running or queued; one more waits up to --queue-wait-s for a "
                        "slot, then gets 429 with Retry-After; 0 = unbounded (default: %(default)s)")
    g.add_argument("--queue-wait-s", type=float, default=10.0,
                   help="how long a request over --max-in-flight waits for a slot (default: %(default)s)")
    g = p.add_argument_group("joining routers (docs/DEPLOY.md)")
    g.add_argument("--join", default=None, metavar="URL[,URL...]",
                   help="prefill/decode: add this worker to these routers' pools once it serves (again every "
                        "10 s, for a router that restarted), and drain it from them at shutdown; the routers "
                        "need the same $KVHANDOFF_SECRET")
    g.add_argument("--advertise-url", default=None, metavar="URL",
                   help="with --join: the URL routers reach this worker at (default: the one it is bound to; "
                        "needed when --host is 0.0.0.0 or ::)")
    p.set_defaults(func=cmd_serve)


def add_router_command(sub) -> None:
    p = sub.add_parser("router", help="the OpenAI-compatible front over prefill and decode workers",
                       description=cmd_router.__doc__)
    p.add_argument("--prefill", required=True, metavar="URL[,URL...]", help="prefill workers' base URLs")
    p.add_argument("--decode", required=True, metavar="URL[,URL...]", help="decode workers' base URLs")
    p.add_argument("--mode", required=True, choices=modes.NAMES, help="handoff protocol (docs/HANDOFF.md)")
    p.add_argument("--kv-secret", default=None,
                   help="the deployment secret; prefer the environment variable KVHANDOFF_SECRET (a command "
                        "line is visible to every local user)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take end to end, streams included (default: %(default)s)")
    p.add_argument("--retry-colocated", action="store_true",
                   help="when a prefill worker fails (5xx, unreachable, died), have the decode worker compute the "
                        "request itself instead of failing it (push: whatever its --kv-load-failure-policy)")
    p.add_argument("--bidirectional", action="store_true",
                   help="multi-turn reuse: remember where each conversation's KV is kept (X-Session-Id header, "
                        "session_id field, or prompt block-hash match) and have the next turn's prefill read it "
                        "back; the workers need --bidirectional too")
    p.add_argument("--engine", choices=[e.value for e in modes.Engine], default=modes.Engine.KVHANDOFF.value,
                   help="what the workers are: kvhandoff workers, or vLLM OpenAI servers with a NIXL connector "
                        "(NixlConnector for pull, NixlPushConnector for push; docs/VLLM.md) (default: %(default)s)")
    p.add_argument("--retention-ttl", type=float, default=480.0, metavar="S",
                   help="--engine vllm with --bidirectional: how long the decode workers keep a turn's KV (their "
                        "decoder_kv_blocks_ttl) (default: %(default)s)")
    g = p.add_argument_group("more than one router (docs/DEPLOY.md)")
    g.add_argument("--shared-sessions", action="store_true",
                   help="with --bidirectional, when other routers serve the same workers: ask the decode workers "
                        "where a conversation's history is kept at each turn (another router may have served "
                        "the last one), instead of this router's own map")
    g.add_argument("--front-port", type=int, default=None, metavar="PORT",
                   help="listen on this port too, shared with the other routers on this machine that are given "
                        "it (SO_REUSEPORT; same user): the kernel spreads client connections over them")
    add_policy_args(p)
    add_http_args(p, port=8000)
    p.set_defaults(func=cmd_router)


def add_up_command(sub) -> None:
    p = sub.add_parser("up", help="start workers and router locally in one command",
                       description=cmd_up.__doc__)
    p.add_argument("--mode", required=True, choices=modes.STACK_MODES,
                   help="colocated runs one worker on the front port, without a router")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default: %(default)s)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default: %(default)s)")
    p.add_argument("--routers", type=int, default=1,
                   help="routers sharing the front port (SO_REUSEPORT: the kernel spreads connections over them); "
                        "with more than one, each has a port of its own too, a dead one is restarted while the "
                        "others serve, and they find conversations through the decode workers (default: %(default)s)")
    p.add_argument("--router-cores", choices=["any", "prefill"], default="prefill",
                   help="where the router runs when the workers are pinned to cores: prefill (on the prefill workers' "
                        "cores, away from the decode steps whose tokens it relays) or any (the kernel places it, "
                        "which was often beside the decode worker) (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for every /health (default: %(default)s)")
    p.add_argument("--retry-colocated", action="store_true",
                   help="router: a failed prefill is computed on the decode worker instead (see kvhandoff router -h)")
    p.add_argument("--bidirectional", action="store_true",
                   help="multi-turn reuse on the router and every worker (--retention-ttl, --retention-max-bytes, "
                        "--reuse-min-tokens, --reuse-policy are passed to the workers)")
    p.add_argument("--prefill-args", default="", metavar="FLAGS",
                   help="flags for the prefill workers only, e.g. --prefill-args=--no-prefix-caching")
    p.add_argument("--decode-args", default="", metavar="FLAGS", help="flags for the decode workers only")
    p.add_argument("--cores", type=parse_cores, default=None, metavar="LIST",
                   help="cores to share out among the workers, e.g. 0 or 0-3 or 0,2 (default: all this process "
                        "may use)")
    p.add_argument("--worker-args", action="append", default=[], metavar="NAME=FLAGS",
                   help="flags for one worker (prefill-0, decode-1, ...; worker when colocated), repeatable, "
                        "e.g. --worker-args 'decode-1=--inject-faults step_ms=50'")
    p.add_argument("--link", default=None, metavar="RATE[,DELAY[,JITTER]]",
                   help="put the decode workers behind an emulated link, e.g. 1gbit or 1gbit,50us: their own "
                        "network namespace, a veth pair shaped each way by tc (netem; a token bucket, rate only, "
                        "where the kernel has no netem), KV over tcp; removed when the stack stops (needs root "
                        "and iproute2)")
    g = p.add_argument_group("vLLM workers (docs/VLLM.md)")
    g.add_argument("--engine", choices=[e.value for e in modes.Engine], default=modes.Engine.KVHANDOFF.value,
                   help="kvhandoff: our workers; vllm: vLLM OpenAI servers (pull: NixlConnector, with "
                        "bidirectional_kv_xfer under --bidirectional; push: NixlPushConnector; colocated: one "
                        "server) behind our router (default: %(default)s)")
    g.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="--engine vllm: the Python interpreter vLLM (and NIXL) is installed in, e.g. V/bin/python")
    g.add_argument("--retention-ttl", type=float, default=None, metavar="S",
                   help="with --bidirectional: seconds the decode workers keep a finished turn's KV (vLLM's "
                        "decoder_kv_blocks_ttl; ours, --retention-ttl) (default: 480)")
    g.add_argument("--vllm-placement", choices=["vllm", "pin", "pin+idle"], default="pin",
                   help="--engine vllm: where each ready server's threads run: as vLLM leaves them (its NIXL "
                        "connector moves every worker's compute to the machine's last core), back on the worker's "
                        "own cores, or that and the threads that spin while idle (NIXL's progress thread) at "
                        "SCHED_IDLE (docs/VLLM.md has what each costs) (default: %(default)s)")
    g.add_argument("--vllm-stock", action="store_true",
                   help="--engine vllm --bidirectional: run vLLM unpatched (a streamed turn then says nothing "
                        "of where its KV is kept, and is not reused)")
    g.add_argument("--vllm-args", default="", metavar="FLAGS",
                   help="--engine vllm: more flags for every vLLM server, e.g. \"--enforce-eager\"")
    g = p.add_argument_group("on a Ray cluster (docs/DEPLOY.md; needs: pip install 'kvhandoff[ray]')")
    g.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="place the workers on a Ray cluster: ADDRESS is the head's HOST:PORT; without one (or "
                        "`auto`), the cluster this machine belongs to, else a one-node cluster started here. Ray "
                        "restarts a dead worker (--max-restarts), on another node if need be; the routers run here")
    g.add_argument("--prefill-resources", default="", metavar="NAME=N[,...]",
                   help="with --ray: custom Ray resources each prefill worker needs (places them on the nodes "
                        "started with them), e.g. prefill_node=1")
    g.add_argument("--decode-resources", default="", metavar="NAME=N[,...]", help="with --ray: the same for decode")
    g.add_argument("--placement-timeout", type=float, default=60.0,
                   help="with --ray: seconds to wait for the cluster to place every worker before saying which "
                        "resource is short (default: %(default)s)")
    add_policy_args(p)
    p.add_argument("--max-restarts", type=int, default=5,
                   help="a worker that dies is restarted (backoff 1, 2, 4 ... 30 s); one that dies more often "
                        "than this within 300 s is given up, and the others keep serving (default: %(default)s)")
    add_engine_args(p)
    add_http_args(p, port=8000)
    p.set_defaults(func=cmd_up)


def add_workers_command(sub) -> None:
    p = sub.add_parser("workers", help="list, add or remove a running router's workers",
                       description=cmd_workers.__doc__)
    p.add_argument("action", choices=["list", "add", "remove"])
    p.add_argument("--router", default="http://127.0.0.1:8000", help="the router's URL (default: %(default)s)")
    p.add_argument("--role", type=Role, choices=ROLES, help="add: the new worker's role")
    p.add_argument("--url", help="add/remove: the worker's base URL, e.g. http://127.0.0.1:8101")
    p.add_argument("--kv-secret", default=None, help="the deployment secret (prefer $KVHANDOFF_SECRET)")
    p.set_defaults(func=cmd_workers)


def add_bench_command(sub) -> None:
    p = sub.add_parser("bench", help="measure TTFT/TPOT/goodput of an endpoint or of our stacks under a workload",
                       description=cmd_bench.__doc__)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--target", metavar="URL", help="any OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    which.add_argument("--launch", metavar="MODE[,MODE...]",
                       help=f"start `kvhandoff up --mode MODE` for each mode in turn ({', '.join(modes.STACK_MODES)}; "
                            "`+bidirectional`, `+retry-colocated`, `+late-binding` or `+no-prefix-caching` adds "
                            "that flag, `+decode-policy=P`, `+prefill-policy=P`, `+disagg-min-tokens=N`, "
                            "`+health-interval=S`, `+link=RATE` (an emulated link, e.g. 1gbit), "
                            "`+retention-ttl=S` or `+reuse-policy=P` (with +bidirectional) that option, e.g. "
                            "push+bidirectional or push+late-binding+decode-policy=load), measure, stop it")
    p.add_argument("--workload", default="grid",
                   help="grid, binding (grid's rates, a long/short prompt mix, heavy-tailed answers, bursts), "
                        "multiturn, or a JSON-lines file to replay (see kvhandoff/bench/workload.py) "
                        "(default: %(default)s)")
    p.add_argument("--model", default="smollm2", help="--launch: the model to serve (default: %(default)s)")
    p.add_argument("--served-name", default=None, help="model name to send (default: what /v1/models says)")
    p.add_argument("--launch-args", default="", metavar="FLAGS",
                   help="--launch: more flags for `kvhandoff up`, e.g. \"--no-prefix-caching --bidirectional\"")
    p.add_argument("--cores", default="0,1", help="--launch: cores for the stack (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    g = p.add_argument_group("grid workload")
    g.add_argument("--rates", default="0.25,0.5,0.75,0.9",
                   help="Poisson rates as fractions of the measured capacity (default: %(default)s)")
    g.add_argument("--capacity", type=float, default=None, metavar="REQ_S",
                   help="capacity in requests/s (default: measured with a burst on the first target)")
    g.add_argument("--capacity-requests", type=int, default=12)
    g.add_argument("--requests", type=int, default=24, help="requests per rate (default: %(default)s)")
    g.add_argument("--shortest", type=int, default=None, help="tokens (default: longest / 16)")
    g.add_argument("--longest", type=int, default=None,
                   help="tokens (default: chosen so its prefill takes about as long as decoding --output-tokens, "
                        "as the original 16k prompts did)")
    g.add_argument("--output-tokens", type=int, default=128)
    g = p.add_argument_group("multiturn workload")
    g.add_argument("--conversations", type=int, default=4)
    g.add_argument("--turns", type=int, default=6)
    g.add_argument("--new-tokens", type=int, default=300)
    g.add_argument("--answer-tokens", type=int, default=64)
    g.add_argument("--think-s", type=float, default=2.0)
    g.add_argument("--think-profile", default=None, metavar="NAME|FILE",
                   help="think times drawn from a profile instead of around --think-s: chat (median 4 s), agent "
                        "(20 s, tools), review (150 s, a person reading), or a file of seconds, one a line")
    g.add_argument("--resume-after-s", type=float, default=0.0,
                   help="every other conversation's last turn comes back after this long idle (0: never)")
    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT bound")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--save-workload", type=Path, default=None, metavar="FILE",
                   help="write the generated workload (first point) as JSON lines, to replay with --workload FILE")
    g.add_argument("--out", type=Path, default=Path("bench-out"), help="(default: %(default)s)")
    p.set_defaults(func=cmd_bench)


def add_demo_command(sub) -> None:
    p = sub.add_parser("demo", help="every mode side by side in ~5 min: isolated phases over a free and a slow link, "
                                    "then multi-turn reuse",
                       description=cmd_demo.__doc__)
    p.add_argument("--model", default="smollm2", help="smollm2 or tiny (default: %(default)s)")
    p.add_argument("--minutes", type=positive_float, default=5.0,
                   help="time to size the work to, from a short calibration (default: %(default)s)")
    p.add_argument("--link", type=demo_link, default="auto",
                   help="the slow emulated link's rate: auto (calibrated: a prompt's KV moves in ~3/4 of its "
                        "prefill), none (skip; also when not root), or a rate like 200mbit (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("demo-out"), help="(default: %(default)s)")
    p.add_argument("--engine", choices=[e.value for e in modes.Engine], default=modes.Engine.KVHANDOFF.value,
                   help="vllm: the same on vLLM workers behind our router (needs --vllm-python; docs/VLLM.md) "
                        "(default: %(default)s)")
    p.add_argument("--vllm-python", default=None, metavar="PATH", help="--engine vllm: vLLM's interpreter")
    p.set_defaults(func=cmd_demo)


def add_simulate_command(sub) -> None:
    p = sub.add_parser("simulate", help="a calibrated discrete-event model of a fleet, fitted on a bench run",
                       description=cmd_simulate.__doc__)
    from kvhandoff.sim.command import add_args as add_simulate_args
    add_simulate_args(p)
    p.set_defaults(func=cmd_simulate)


def add_bench_transfer_command(sub) -> None:
    p = sub.add_parser("bench-transfer", help="measure the KV transfer backends (GB/s and 4 KiB latency)",
                       description=cmd_bench_transfer.__doc__)
    p.add_argument("--backends", default="shm,tcp,nixl",
                   help="comma-separated; nixl is skipped with a note when not installed (default: %(default)s)")
    p.add_argument("--total-mb", type=int, default=64,
                   help="MiB per transfer, a multiple of 4 (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds after a warm-up (default: %(default)s)")
    p.add_argument("--latency-iters", type=int, default=400,
                   help="4 KiB operations timed per backend and op (default: %(default)s)")
    p.add_argument("--pin", action="store_true", help="pin this process to core 0 and the target to core 1")
    p.add_argument("--shm-dir", default="auto",
                   help="where shared-memory regions live; auto: /dev/shm if it gives huge pages, else a "
                        "huge-page tmpfs private to this benchmark where it may mount one (root), else "
                        "/dev/shm (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.set_defaults(func=cmd_bench_transfer)


def _exit_on_sigterm(signum, frame):
    # uvicorn handles SIGTERM while serving and re-raises it after its graceful shutdown; turning it
    # into SystemExit here lets `finally` blocks (engine loop stop) run and the exit status be 0.
    sys.exit(0)


def main(argv: list[str] | None = None) -> int:
    from kvhandoff.launch.lifeline import hold
    hold()                                   # a child of `kvhandoff up`: stop when it dies
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "up":       # only `up` passes flags it does not know on (to workers)
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 0
    except ModelNotFound as e:              # a user's typo deserves a line, not a traceback
        print(f"kvhandoff {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
