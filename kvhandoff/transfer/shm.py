"""The shm backend: on the same host the initiator maps the peer's shared-memory segments and copies
straight between its own region and the peer's, one memcpy per coalesced segment, no peer CPU.

Only the peer's region has to live in shared memory: the initiator's side is its own address space,
so a private tensor works as the local end of an shm transfer. Handshake, notifications and liveness
still travel over the tcp control connection.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from collections.abc import Callable

import numpy as np

from kvhandoff.transfer.descriptors import Plan
from kvhandoff.transfer.handle import Op
from kvhandoff.transfer.memory import SHM_DIR, Segment, open_segment

log = logging.getLogger(__name__)


def host_id() -> str:
    """Same value for two agents exactly when they share a kernel and a /dev/shm.

    The boot id names the running kernel (machine-id alone is copied into cloned images), and the
    device number of /dev/shm tells tmpfs instances apart (containers on one kernel may each have
    their own). Opening a segment still checks its inode, so a wrong guess only costs a fallback.
    """
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("")
    try:
        parts.append(str(os.stat(SHM_DIR).st_dev))
    except OSError:
        parts.append("no-shm")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def map_grants(grants: dict[str, dict], mapped: dict[str, Segment]) -> tuple[dict[str, Segment], dict[str, np.ndarray], dict[str, str]]:
    """Map the segments behind a peer's granted regions, reusing those already mapped.

    Returns (segments by name, a byte view per shm-backed region, why each unmappable region is not).
    A region whose segment cannot be opened is simply left to tcp.
    """
    extent: dict[str, int] = {}
    for g in grants.values():
        if g.get("shm"):
            extent[g["shm"]] = max(extent.get(g["shm"], 0), g["shm_offset"] + g["nbytes"])
    segments, failed = {}, {}
    for name, size in extent.items():
        seg = mapped.get(name)
        if seg is None or seg.array is None or seg.nbytes < size:
            try:
                g = next(g for g in grants.values() if g.get("shm") == name)
                seg = open_segment(g["shm_dir"], name, g["shm_dev_ino"], size)
            except OSError as e:
                failed[name] = str(e)
                continue
        segments[name] = seg
    for name, seg in mapped.items():
        if name not in segments:
            seg.release()
    views, why = {}, {}
    for region, g in grants.items():
        seg = segments.get(g.get("shm") or "")
        if seg is not None:
            views[region] = seg.array[g["shm_offset"]:g["shm_offset"] + g["nbytes"]]
        else:
            why[region] = failed.get(g.get("shm") or "", "not in shared memory")
    return segments, views, why


def copy(op: Op, p: Plan, local: list[np.ndarray], remote: list[np.ndarray]) -> None:
    """Run a plan as plain copies: READ remote -> local, WRITE local -> remote.

    `local[i]` / `remote[i]` are the byte views of the plan's i-th local / remote region name. numpy
    slice assignment is memcpy underneath and releases the GIL for large blocks; the per-segment
    cost is ~1 us, which is why the plan coalesces first.
    """
    rows = list(zip(p.local.region.tolist(), p.local.offset.tolist(),
                    p.remote.region.tolist(), p.remote.offset.tolist(), p.local.length.tolist()))
    # The mapped views end where the grants ended when they were mapped: a plan that reaches past
    # them (forged or stale grants) fails here, before the first byte moves, not halfway through.
    if len(rows) == 1:
        lr, lo, rr, ro, n = rows[0]
        outside = lo < 0 or ro < 0 or lo + n > local[lr].size or ro + n > remote[rr].size
    else:
        outside = _outside(p.local, local) or _outside(p.remote, remote)
    if outside:
        raise ValueError("a segment reaches outside the mapped region")
    if op is Op.READ:
        for lr, lo, rr, ro, n in rows:
            local[lr][lo:lo + n] = remote[rr][ro:ro + n]
    else:
        for lr, lo, rr, ro, n in rows:
            remote[rr][ro:ro + n] = local[lr][lo:lo + n]


def _outside(side, arrays: list[np.ndarray]) -> bool:
    ends = np.zeros(len(arrays), np.int64)
    np.maximum.at(ends, side.region, side.offset + side.length)
    return bool((ends > [a.size for a in arrays]).any() or (side.offset < 0).any())


class CopyJob:
    """A copy that runs once, on whichever thread claims it first: the worker, or a caller that
    starts waiting before the worker got to it (then the copy costs no thread hand-off at all)."""

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn
        self._claimed = False
        self._lock = threading.Lock()

    def run_unless_claimed(self) -> None:
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        self._fn()


class CopyWorker:
    """One thread that runs large copies, so read()/write() return at once like on every backend."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob) -> None:
        self._jobs.put(job)

    def stop(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.run_unless_claimed()
            except Exception:                       # jobs report their own errors; never die silently
                log.exception("copy job failed")
