"""`kvhandoff bench-transfer`: GB/s of READ and WRITE per backend and block size between two
processes, next to a single-thread memcpy and a raw loopback sendmsg stream measured in the same run,
plus the p50/p99 latency of one 4 KiB operation.

Each transfer moves `total` bytes as blocks scattered with a stride (every other block of a pool
twice that size, on both sides), like the blocks of a paged KV pool, so nothing coalesces and every
block is a descriptor on the wire. memcpy copies the same block pattern between two private arrays,
and again between the very buffers the transfers use. The sendmsg streams gather the same block
pattern out of private page-aligned memory into one socket and receive it contiguously, from the
target (pull, a READ's direction) and to it (push, a WRITE's): what a hand-written loopback transfer
would reach. A second pair of streams gathers from and scatters into the very blocks a tcp transfer
moves, so the protocol alone stands against it. Measurements alternate within
every repeat after a warm-up, each from cold caches, and ratios are medians of per-repeat ratios
(MEASURING.md). The table's second line says how much of the segments huge pages map: on a 2-core
Zen 4 VM, shm copied at 0.58-0.88x a private memcpy with 4 KiB pages (a /dev/shm without huge=) and
at 0.69-1.10x with huge pages (a tmpfs mounted with huge=within_size), run to run. So by default
(`--shm-dir auto`) the regions go where `kvhandoff up` puts its workers' pools (huge_tmpfs.py).
"""
from __future__ import annotations

import mmap
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvhandoff.transfer.descriptors import DescList
from kvhandoff.transfer.huge_tmpfs import private_huge_tmpfs
from kvhandoff.transfer.memory import huge_page_share, open_segment, tmpfs_huge
from kvhandoff.transfer.protocol import (ALIGN, ConnectionLost, recv_exact, recv_filling, recv_into_buffers,
                                         send_buffers, tune)

KIB, MIB = 1 << 10, 1 << 20
BLOCK_SIZES = (16 * KIB, 256 * KIB, 4 * MIB)
LATENCY_BYTES = 4 * KIB
SECRET = os.urandom(32)
GET, PUT, DONE = (word.ljust(ALIGN) for word in (b"get", b"put", b"done"))


@dataclass
class BenchConfig:
    backends: tuple[str, ...] = ("shm", "tcp", "nixl")
    total_bytes: int = 64 * MIB
    repeats: int = 7
    latency_iters: int = 400
    pin: bool = False
    shm_dir: str = "auto"           # auto: a private huge-page tmpfs where we may mount one (huge_tmpfs.py)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- baselines

def serve_stream(total: int, block: int, pool: np.ndarray | None = None) -> int:
    """Listen on loopback for one StreamClient; returns the port. Per command (a 64-byte line, like
    our frame headers, so that no copy runs out of step with the blocks: protocol.py): GET, gather-send
    `total` bytes in strided blocks (like a READ's reply); PUT, receive `total` bytes, then answer
    DONE (like a WRITE). With `pool` (the target's registered region), both use its very blocks, the
    push scattered into them as a WRITE lands; without it, a private pool, and the push lands
    contiguously."""
    listener = socket.create_server(("127.0.0.1", 0))
    end = StreamEnd.of(total, block, pool)

    def serve() -> None:
        conn, _ = listener.accept()
        listener.close()
        tune(conn, None)
        with conn:
            while True:
                try:
                    command = recv_exact(conn, len(GET))
                except ConnectionLost:
                    return
                if command == GET:
                    send_buffers(conn, end.blocks)
                else:
                    end.receive(conn)
                    conn.sendall(DONE)
    threading.Thread(target=serve, name="bench-stream", daemon=True).start()
    return listener.getsockname()[1]


def page_aligned(nbytes: int, fill: int) -> np.ndarray:
    """Private memory that starts on a page, like a registered region. numpy's own large arrays start
    16 bytes into theirs (malloc's header), and the kernel's socket copies run 2-3x slower when the
    two sides of a copy are out of step by such an amount (protocol.py): a baseline there would
    measure the misalignment, not the machine."""
    mapping = mmap.mmap(-1, nbytes)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)       # as numpy asks for its large arrays
    except (AttributeError, OSError):             # no transparent huge pages here
        pass
    array = np.frombuffer(mapping, np.uint8)
    array[:] = fill
    return array


@dataclass
class StreamEnd:
    """One end of a raw stream: the strided blocks it sends, and where it receives (into the same
    blocks, as a transfer lands, or contiguously into `sink`)."""
    blocks: list[memoryview]
    sink: memoryview | None

    @classmethod
    def of(cls, total: int, block: int, pool: np.ndarray | None) -> StreamEnd:
        """Every other `block` of `pool` (2 x total bytes, the layout every transfer here moves), or of
        private page-aligned memory with a contiguous sink when there is no pool."""
        view = memoryview(pool if pool is not None else page_aligned(2 * total, 1))
        return cls([view[2 * i * block:2 * i * block + block] for i in range(total // block)],
                   memoryview(page_aligned(total, 0)) if pool is None else None)

    def receive(self, sock: socket.socket) -> None:
        if self.sink is None:
            recv_into_buffers(sock, self.blocks)
        else:
            recv_filling(sock, self.sink)


class StreamClient:
    """The raw baseline: one loopback TCP stream to the target process, no protocol at all. With
    `pool` (the initiator's registered region), it gathers from and scatters into that region's
    blocks, and the target (started with its own region) does the same: the bytes, the memory and
    the socket calls of a READ or WRITE, without the protocol."""

    def __init__(self, port: int, total: int, block: int, pool: np.ndarray | None = None):
        self.sock = socket.create_connection(("127.0.0.1", port))
        tune(self.sock, None)
        self.end = StreamEnd.of(total, block, pool)

    def pull(self) -> float:
        """Seconds to receive `total` bytes the target gathers and sends (a READ's direction)."""
        t0 = time.perf_counter()
        self.sock.sendall(GET)
        self.end.receive(self.sock)
        return time.perf_counter() - t0

    def push(self) -> float:
        """Seconds to gather-send `total` bytes to the target until it has them all (a WRITE's direction)."""
        t0 = time.perf_counter()
        send_buffers(self.sock, [PUT, *self.end.blocks])
        if recv_exact(self.sock, len(DONE)) != DONE:
            raise ConnectionError("stream peer closed")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()


_FLUSH = None


def flushed(measurement):
    """Sweep the caches (read 128 MiB, one load per cache line), then run `measurement`."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = np.ones(128 * MIB, np.uint8)
    _FLUSH[::64].sum()
    return measurement()


def memcpy_run(src: np.ndarray, dst: np.ndarray, block: int, total: int) -> float:
    t0 = time.perf_counter()
    for off in range(0, 2 * total, 2 * block):
        dst[off:off + block] = src[off:off + block]
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- the run

def run(cfg: BenchConfig) -> dict:
    from kvhandoff.transfer.nixl_backend import unavailable_reason

    backends = list(cfg.backends)
    skipped = {}
    if "nixl" in backends and (why := unavailable_reason()) is not None:
        backends.remove("nixl")
        skipped["nixl"] = why
        log(f"bench-transfer: skipping nixl: {why}")
    assert all(cfg.total_bytes % b == 0 for b in BLOCK_SIZES), "total must be a multiple of 4 MiB"
    if cfg.pin:
        os.sched_setaffinity(0, {0})
    private = private_huge_tmpfs(flag="--shm-dir") if cfg.shm_dir == "auto" else None
    shm_dir = private.path if private else cfg.shm_dir
    if private:
        log(f"bench-transfer: shm regions: {private.why}")
    try:
        report = _run(cfg, backends, skipped, shm_dir)
    finally:
        if private:
            private.close()
    report["config"]["shm_why"] = private.why if private else "given"
    return report


def _run(cfg: BenchConfig, backends: list[str], skipped: dict, shm_dir: str) -> dict:
    from kvhandoff.transfer import TransferAgent
    from kvhandoff.transfer.remote import RemoteAgent

    total = cfg.total_bytes
    load_before = os.getloadavg()
    log(f"bench-transfer: {total // MIB} MiB per transfer, backends {backends}, {cfg.repeats} repeats, "
        f"load {load_before[0]:.2f}")

    target = RemoteAgent(prefix=["taskset", "-c", "1"] if cfg.pin else ())
    agents, segments = {}, []
    try:
        meta = target.call("create", "bench-target", SECRET, backend="nixl" if "nixl" in backends else "auto",
                           shm_dir=shm_dir)
        target.call("allocate", "kv", 2 * total)
        target.call("fill", "kv", seed=0)
        for b in backends:
            agent = agents[b] = TransferAgent(f"bench-{b}", SECRET, backend=b, shm_dir=shm_dir)
            agent._allocate("kv", 2 * total)[:] = 1           # touch every page before timing
            agent.add_peer(meta)
        src, dst = np.ones(2 * total, np.uint8), np.ones(2 * total, np.uint8)
        # memcpy again, between the very buffers the transfers use (the target's region, mapped here,
        # into an initiator's region). On this kind of VM two equal buffers can copy at 7 or 13 GB/s
        # depending on where their pages happen to land, so this row is the like-for-like baseline.
        same = _same_memory(agents, segments)
        # The raw stream again, between the very buffers a tcp transfer moves: what the protocol alone
        # costs, whatever the memory.
        stream_pool = (agents.get("tcp") or next(iter(agents.values())))._regions["kv"].array if agents else None
        seconds: dict[tuple[str, str, int], list[float]] = {}
        loads: dict[int, list[float]] = {}
        for block in BLOCK_SIZES:
            loads[block] = [round(x, 2) for x in os.getloadavg()]
            log(f"bench-transfer: {block // KIB} KiB blocks (load {loads[block][0]})")
            descs = DescList.blocks("kv", range(0, 2 * (total // block), 2), block)
            stream = StreamClient(target.call("stream_serve", total, block), total, block)
            same_stream = StreamClient(target.call("stream_serve", total, block, "kv"), total, block,
                                       stream_pool) if stream_pool is not None else None

            def measure() -> dict[tuple[str, str, int], float]:
                # Each measurement starts from the same cold cache: otherwise whatever ran just before
                # (a stream that swept the caches, or a copy of the same buffers) tilts the next one.
                out = {("memcpy", "-", block): flushed(lambda: memcpy_run(src, dst, block, total)),
                       ("sendmsg", "read", block): flushed(stream.pull),
                       ("sendmsg", "write", block): flushed(stream.push)}
                if same is not None:
                    out[("memcpy-same", "-", block)] = flushed(lambda: memcpy_run(*same, block, total))
                if same_stream is not None:
                    out[("sendmsg-same", "read", block)] = flushed(same_stream.pull)
                    out[("sendmsg-same", "write", block)] = flushed(same_stream.push)
                for b, agent in agents.items():
                    for op in ("read", "write"):
                        out[(b, op, block)], h = flushed(lambda: _timed(agent, op, descs))
                        assert h.wire_descs == len(descs) and h.backend == b
                return out
            measure()                                          # warm-up: page faults, socket buffers, caches
            for _ in range(cfg.repeats):
                for key, s in measure().items():
                    seconds.setdefault(key, []).append(s)
            stream.close()
            if same_stream is not None:
                same_stream.close()
        pages = _pages(same, shm_dir)
        latency = {}
        for b, agent in agents.items():
            for op in ("read", "write"):
                log(f"bench-transfer: {b} {op} latency")
                latency[(b, op)] = _latency(agent, op, cfg.latency_iters)
    finally:
        for agent in agents.values():
            agent.close()
        for segment in segments:
            segment.release()
        target.close()
    load_after = os.getloadavg()
    report = _report(cfg, backends, skipped, seconds, latency, load_before, load_after, shm_dir)
    report["loadavg_by_block"] = loads
    report["pages"] = pages
    return report


def _pages(same, shm_dir: str) -> dict:
    """How much of the buffers the transfers copy between huge pages map: 4 KiB pages copy at ~0.7x
    huge-page memcpy on a VM, which is most of any gap in the x memcpy column (memory.py)."""
    huge = tmpfs_huge(shm_dir)
    return {"shm_dir_huge": huge,
            "target_huge_share": huge_page_share(same[0]) if same else None,
            "initiator_huge_share": huge_page_share(same[1]) if same else None}


def _same_memory(agents: dict, segments: list) -> tuple[np.ndarray, np.ndarray] | None:
    """(the target's region mapped here, an initiator's region): what the transfers copy between."""
    if not agents:
        return None
    agent = agents.get("shm") or next(iter(agents.values()))
    grant = agent._peers["bench-target"].grants["kv"]
    segment = open_segment(grant["shm_dir"], grant["shm"], grant["shm_dev_ino"], grant["nbytes"])
    segments.append(segment)
    return segment.array[grant["shm_offset"]:grant["shm_offset"] + grant["nbytes"]], agent._regions["kv"].array


def _timed(agent, op: str, descs) -> tuple[float, object]:
    """Wall time of one operation as a caller sees it: posting (planning included) to wait() returning."""
    t0 = time.perf_counter()
    h = getattr(agent, op)("bench-target", descs, descs)
    h.wait(120)
    return time.perf_counter() - t0, h


def _latency(agent, op: str, iters: int) -> list[float]:
    one = [("kv", 0, LATENCY_BYTES)]
    times = [_timed(agent, op, one)[0] for _ in range(iters + iters // 10)]
    return times[iters // 10:]                                  # the first tenth is warm-up


def _report(cfg: BenchConfig, backends: list[str], skipped: dict, seconds: dict, latency: dict,
            load_before, load_after, shm_dir: str) -> dict:
    total = cfg.total_bytes
    gbps = {k: total / statistics.median(v) / 1e9 for k, v in seconds.items()}

    def ratio(key, base) -> float:
        return statistics.median(b / a for a, b in zip(seconds[key], seconds[base]))   # per-repeat, then median

    results, ratios = [], []
    for block in BLOCK_SIZES:
        for b in backends:
            for op in ("read", "write"):
                s = sorted(seconds[(b, op, block)])
                results.append({"backend": b, "op": op, "block_bytes": block, "gbps": round(gbps[(b, op, block)], 3),
                                "p50_us": round(_pct(s, 50) * 1e6, 1), "p99_us": round(_pct(s, 99) * 1e6, 1)})
                ratios.append({"backend": b, "op": op, "block_bytes": block,
                               "vs_memcpy": round(ratio((b, op, block), ("memcpy", "-", block)), 3),
                               "vs_memcpy_same_memory": round(ratio((b, op, block), ("memcpy-same", "-", block)), 3),
                               "vs_sendmsg": round(ratio((b, op, block), ("sendmsg", op, block)), 3),
                               "vs_sendmsg_same_memory": round(ratio((b, op, block), ("sendmsg-same", op, block)), 3)})
    for (b, op), times in latency.items():
        s = sorted(times)
        results.append({"backend": b, "op": op, "block_bytes": LATENCY_BYTES,
                        "gbps": round(LATENCY_BYTES / _pct(s, 50) / 1e9, 4),
                        "p50_us": round(_pct(s, 50) * 1e6, 1), "p99_us": round(_pct(s, 99) * 1e6, 1)})
    return {
        "memcpy_gbps": {b: round(gbps[("memcpy", "-", b)], 3) for b in BLOCK_SIZES},
        "memcpy_same_memory_gbps": {b: round(gbps[("memcpy-same", "-", b)], 3) for b in BLOCK_SIZES
                                    if ("memcpy-same", "-", b) in gbps},
        "sendmsg_gbps": {b: round(gbps[("sendmsg", "read", b)], 3) for b in BLOCK_SIZES},
        "sendmsg_push_gbps": {b: round(gbps[("sendmsg", "write", b)], 3) for b in BLOCK_SIZES},
        "sendmsg_same_memory_gbps": {b: round(gbps[("sendmsg-same", "read", b)], 3) for b in BLOCK_SIZES
                                     if ("sendmsg-same", "read", b) in gbps},
        "sendmsg_push_same_memory_gbps": {b: round(gbps[("sendmsg-same", "write", b)], 3) for b in BLOCK_SIZES
                                          if ("sendmsg-same", "write", b) in gbps},
        "results": results,
        "ratios": ratios,
        "skipped": skipped,
        "config": {"total_bytes": total, "repeats": cfg.repeats, "latency_iters": cfg.latency_iters,
                   "latency_bytes": LATENCY_BYTES, "layout": "every other block of a pool twice the size, both sides",
                   "pinned": "parent core 0, target core 1" if cfg.pin else "no", "cpus": os.cpu_count(),
                   "shm_dir": shm_dir,
                   "git_commit": _git_commit()},
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
    }


def _pct(sorted_values: list[float], q: float) -> float:
    return float(np.percentile(sorted_values, q))


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__), timeout=5).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def format_table(report: dict) -> str:
    """The report as the table the CLI prints."""
    lines = [f"bench-transfer: {report['config']['total_bytes'] // MIB} MiB per transfer "
             f"({report['config']['layout']}), {report['config']['repeats']} repeats, shm in "
             f"{report['config']['shm_dir']}, "
             f"commit {report['config']['git_commit']}, load avg before {report['loadavg_before']} "
             f"after {report['loadavg_after']}",
             _pages_line(report.get("pages"), report["config"]["shm_dir"]),
             "x memcpy: against memcpy between private arrays; x same mem: against memcpy between the buffers "
             "the transfers use; x sendmsg: against a raw stream in the same direction (pull for read, push "
             "for write) between private buffers; x sendmsg same: the same stream between the very blocks the "
             "transfers move (what the protocol alone costs); ratios are medians of per-repeat ratios",
             f"{'backend':<8} {'op':<6} {'block':>8} {'GB/s':>7} {'x memcpy':>9} {'x same mem':>11} {'x sendmsg':>10} "
             f"{'x sendmsg same':>15} {'p50 us':>9} {'p99 us':>9}"]
    ratios = {(r["backend"], r["op"], r["block_bytes"]): r for r in report["ratios"]}
    same = report["memcpy_same_memory_gbps"]
    for block in BLOCK_SIZES:
        lines.append(f"{'memcpy':<8} {'-':<6} {_size(block):>8} {report['memcpy_gbps'][block]:>7.2f}")
        if block in same:
            lines.append(f"{'memcpy':<8} {'same':<6} {_size(block):>8} {same[block]:>7.2f}")
        lines.append(f"{'sendmsg':<8} {'pull':<6} {_size(block):>8} {report['sendmsg_gbps'][block]:>7.2f}")
        lines.append(f"{'sendmsg':<8} {'push':<6} {_size(block):>8} {report['sendmsg_push_gbps'][block]:>7.2f}")
        for op, key in (("pull", "sendmsg_same_memory_gbps"), ("push", "sendmsg_push_same_memory_gbps")):
            if block in report.get(key, {}):
                lines.append(f"{'sendmsg':<8} {op:<6} {_size(block):>8} {report[key][block]:>7.2f}  (same memory)")
        for r in report["results"]:
            if r["block_bytes"] == block:
                q = ratios[(r["backend"], r["op"], block)]
                lines.append(f"{r['backend']:<8} {r['op']:<6} {_size(block):>8} {r['gbps']:>7.2f} {q['vs_memcpy']:>9.2f} "
                             f"{q['vs_memcpy_same_memory']:>11.2f} {q['vs_sendmsg']:>10.2f} "
                             f"{q['vs_sendmsg_same_memory']:>15.2f} {r['p50_us']:>9.0f} {r['p99_us']:>9.0f}")
    for r in report["results"]:
        if r["block_bytes"] == LATENCY_BYTES:
            lines.append(f"{r['backend']:<8} {r['op']:<6} {_size(LATENCY_BYTES):>8} {r['gbps']:>7.3f} "
                         f"{'':>9} {'':>11} {'':>10} {'':>15} {r['p50_us']:>9.1f} {r['p99_us']:>9.1f}")
    for name, why in report["skipped"].items():
        lines.append(f"{name}: skipped ({why})")
    return "\n".join(lines)


def _pages_line(pages: dict | None, shm_dir: str) -> str:
    if not pages:
        return "shm segments: pages unknown"
    pct = lambda x: "?" if x is None else f"{100 * x:.0f}%"
    kind = {True: "a tmpfs with huge pages", False: "a tmpfs with 4 KiB pages: mount one with huge=within_size "
            "and pass --shm-dir: copies closer to memcpy speed", None: "not a tmpfs"}[pages["shm_dir_huge"]]
    return (f"shm segments in {shm_dir} ({kind}): huge pages map {pct(pages['target_huge_share'])} of the "
            f"target's region, {pct(pages['initiator_huge_share'])} of the initiator's")


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"
