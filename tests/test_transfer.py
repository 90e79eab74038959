"""The data plane: descriptor plans, and two real processes moving random bytes over shm, tcp and
nixl, refusing what they must refuse, and failing (not hanging) when the peer dies or hangs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from conftest import may_mount
from kvhandoff.model import pages
from kvhandoff.transfer import (AuthenticationError, DescList, OutOfBoundsError, PeerError, TransferAgent,
                                TransferError, XferState)
from kvhandoff.transfer.descriptors import plan
from kvhandoff.transfer.memory import SHM_DIR, create_segment, open_segment, sweep_stale_segments, tmpfs_huge
from kvhandoff.transfer.nixl_backend import unavailable_reason
from kvhandoff.transfer.protocol import LARGE_RECV, ConnectionLost, recv_into_buffers
from kvhandoff.transfer.remote import RemoteAgent, RemoteError, digest

pytestmark = pytest.mark.timeout(120)
SECRET = b"test-secret-0123456789"
KIB, MIB = 1 << 10, 1 << 20
NIXL_MISSING = unavailable_reason()
BACKENDS = ["shm", "tcp", pytest.param("nixl", marks=pytest.mark.skipif(NIXL_MISSING is not None,
                                                                         reason=str(NIXL_MISSING)))]


def segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith("kvh.") and n.split(".")[2] == str(pid)]


def scattered(rng: np.random.Generator, sizes: list[int], region_bytes: int) -> list[int]:
    """Offsets for ranges of `sizes`, placed in random order with a gap after each (never adjacent)."""
    offsets, pos = [0] * len(sizes), int(rng.integers(0, 4096))
    for k in rng.permutation(len(sizes)).tolist():
        offsets[k] = pos
        pos += sizes[k] + int(rng.integers(1, 4096))
    assert pos <= region_bytes
    return offsets


def complement(descs: list[tuple[str, int, int]], region_bytes: int) -> list[tuple[str, int, int]]:
    """The ranges of a region that `descs` do not cover."""
    out, pos = [], 0
    for region, offset, length in sorted(descs, key=lambda d: d[1]):
        if offset > pos:
            out.append((region, pos, offset - pos))
        pos = offset + length
    return out + ([(descs[0][0], pos, region_bytes - pos)] if pos < region_bytes else [])


# Sizes from 1 KiB to 8 MiB (odd ones too), plus 400 scattered 4 KiB blocks: many descriptors.
SIZES = [1 * KIB, 1 * KIB + 1, 4 * KIB, 16 * KIB, 64 * KIB, 100 * KIB + 7, 256 * KIB, 1 * MIB, 3 * MIB, 8 * MIB] + [4 * KIB] * 400
REGION = 24 * MIB


@pytest.fixture
def remote():
    r = RemoteAgent()
    yield r
    r.close()


def make_pair(remote: RemoteAgent, backend: str, region_bytes: int = REGION, **kw):
    """A local agent and the remote one, each with a shared-memory region 'kv'; local knows remote."""
    meta = remote.call("create", "remote", SECRET, backend=backend, **kw)
    remote.call("allocate", "kv", region_bytes)
    local = TransferAgent("local", SECRET, backend=backend, **kw)
    kv = local.allocate_region("kv", region_bytes).numpy()
    assert local.add_peer(meta) == "remote"
    return local, kv


# ------------------------------------------------------------------------------------------- plans

def test_plan_coalesces_only_what_is_adjacent_on_both_sides():
    blocks = DescList.blocks("kv", range(64), 16 * KIB)
    assert len(plan(blocks, blocks)) == 1                                   # contiguous both sides
    strided = DescList.blocks("kv", range(0, 128, 2), 16 * KIB)
    assert len(plan(blocks, strided)) == 64                                 # remote side scattered
    assert len(plan(strided, strided)) == 64
    one = DescList.of([("buf", 0, 64 * 16 * KIB)])                          # one local, 64 remote pieces
    p = plan(one, strided)
    assert len(p) == 64 and p.local.offset.tolist() == [i * 16 * KIB for i in range(64)]
    assert p.remote.offset.tolist() == [2 * i * 16 * KIB for i in range(64)]


def test_plan_matches_a_byte_by_byte_reference():
    rng = np.random.default_rng(7)
    for _ in range(50):
        lengths_l = rng.integers(1, 9, rng.integers(1, 12)).tolist()
        total = sum(lengths_l)
        cuts = sorted(set(rng.integers(1, total, rng.integers(0, 6)).tolist())) if total > 1 else []
        lengths_r = np.diff([0, *cuts, total]).tolist()
        local = [("a" if rng.random() < .7 else "b", int(rng.integers(0, 3)) * 8 + 64 * i, n) for i, n in enumerate(lengths_l)]
        remote = [("r", 64 * i + int(rng.integers(0, 2)), n) for i, n in enumerate(lengths_r)]
        p = plan(DescList.of(local), DescList.of(remote))
        expand = lambda ds: [(r, o + k) for r, o, n in ds for k in range(n)]
        got_l = [(p.local.names[r], o + k) for r, o, n in zip(p.local.region, p.local.offset, p.local.length) for k in range(n)]
        got_r = [(p.remote.names[r], o + k) for r, o, n in zip(p.remote.region, p.remote.offset, p.remote.length) for k in range(n)]
        assert got_l == expand(local) and got_r == expand(remote)
        merged = sum(1 for i in range(1, len(got_l)) if got_l[i] == (got_l[i - 1][0], got_l[i - 1][1] + 1)
                     and got_r[i] == (got_r[i - 1][0], got_r[i - 1][1] + 1))
        assert len(p) == len(got_l) - merged                                # maximal coalescing


def test_bounds_and_shape_errors_are_clear():
    sizes = {"kv": 100}
    for bad in ([("kv", 90, 11)], [("kv", -1, 5)], [("kv", 0, 0)], [("other", 0, 1)], [("kv", 2**62, 2**62)]):
        with pytest.raises(OutOfBoundsError):
            DescList.of(bad).check_bounds(sizes, "local")
    with pytest.raises(ValueError, match="cover"):
        plan(DescList.of([("kv", 0, 10)]), DescList.of([("kv", 0, 11)]))


# ------------------------------------------------------------------------------------------- two processes

@pytest.mark.parametrize("backend", BACKENDS)
def test_read_and_write_random_data_between_processes(remote, backend):
    local, kv = make_pair(remote, backend)
    with local:
        rng = np.random.default_rng(1)
        remote_descs = [("kv", o, n) for o, n in zip(scattered(rng, SIZES, REGION), SIZES)]
        local_descs = [("kv", o, n) for o, n in zip(scattered(rng, SIZES, REGION), SIZES)]
        remote.call("fill", "kv", seed=11)

        h = local.read("remote", local_descs, remote_descs).wait(30)
        assert h.backend == backend and h.wire_descs == len(SIZES) and h.nbytes == sum(SIZES)
        assert digest(kv, local_descs) == remote.call("digest", "kv", remote_descs)

        kv[:] = np.random.default_rng(12).integers(0, 256, kv.size, dtype=np.uint8)
        untouched = complement(remote_descs, REGION)
        before = remote.call("digest", "kv", untouched)
        local.write("remote", local_descs, remote_descs).wait(30)
        assert remote.call("digest", "kv", remote_descs) == digest(kv, local_descs)
        assert remote.call("digest", "kv", untouched) == before             # nothing written outside

        # The other direction: the remote process initiates, against our region.
        local_meta = local.metadata()
        assert remote.call("add_peer", local_meta) == "local"
        kv[:] = np.random.default_rng(13).integers(0, 256, kv.size, dtype=np.uint8)
        result = remote.call("xfer", "read", "local", remote_descs, local_descs)
        assert result["error"] is None and result["backend"] == backend
        assert remote.call("digest", "kv", remote_descs) == digest(kv, local_descs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_notifications_arrive_after_the_data(remote, backend):
    local, kv = make_pair(remote, backend, region_bytes=4 * MIB)
    with local:
        remote.call("fill", "kv", seed=3)
        local.read("remote", [("kv", 0, MIB)], [("kv", MIB, MIB)], notify=b"read:1").wait(10)
        kv[:MIB] = 42
        local.write("remote", [("kv", 0, MIB)], [("kv", 0, MIB)], notify=b"write:2").wait(10)
        local.send_notification("remote", b"plain:3")
        assert remote.call("notifications", 3) == [("local", b"read:1"), ("local", b"write:2"), ("local", b"plain:3")]
        assert remote.call("digest", "kv", [("kv", 0, MIB)]) == digest(kv, [("kv", 0, MIB)])
        # The remote never added us as a peer, but can answer over our connection to it.
        remote.call("send_notification", "local", b"reply:4")
        assert local.wait_notification(5) == ("remote", b"reply:4")
        assert local.get_notifications() == [] and local.wait_notification(0.05) is None


def test_coalescing_across_processes(remote):
    local, _ = make_pair(remote, "tcp", region_bytes=4 * MIB)
    with local:
        remote.call("fill", "kv", seed=5)
        adjacent = DescList.blocks("kv", range(64), 16 * KIB)
        assert local.read("remote", adjacent, adjacent).wait(10).wire_descs == 1
        strided = DescList.blocks("kv", range(0, 128, 2), 16 * KIB)
        h = local.read("remote", adjacent, strided).wait(10)
        assert h.wire_descs == 64 and h.nbytes == MIB


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_out_of_bounds_is_refused_and_changes_nothing(remote, backend):
    local, kv = make_pair(remote, backend, region_bytes=MIB)
    with local:
        original = remote.call("fill", "kv", seed=9)
        kv[:] = 1
        for bad in ([("kv", MIB - 100, 200)], [("kv", -4096, 200)], [("nope", 0, 200)]):
            for op in (local.read, local.write):
                with pytest.raises(OutOfBoundsError, match="peer 'remote'"):
                    op("remote", [("kv", 0, 200)], bad)
        with pytest.raises(OutOfBoundsError, match="local"):
            local.write("remote", [("kv", MIB - 1, 200)], [("kv", 0, 200)])
        # An initiator whose own check is fooled (forged grants) still cannot get through: over tcp the
        # serving side re-checks; over shm the mapped view only spans what was granted when mapped.
        local._peers["remote"].grants["kv"]["nbytes"] = 2 * MIB
        refusal = "refused by 'remote'.*outside" if backend == "tcp" else "copy failed"
        for op in (local.write, local.read):
            # The first descriptor is fine, the second reaches past the end: nothing may move at all.
            h = op("remote", [("kv", 0, 4096), ("kv", 8192, 8192)], [("kv", 0, 4096), ("kv", MIB - 4096, 8192)])
            with pytest.raises(TransferError, match=refusal):
                h.wait(10)
            assert h.state is XferState.ERROR and h.backend == backend
        assert (kv == 1).all()
        assert remote.call("digest", "kv") == original
        local.write("remote", [("kv", 0, 4096)], [("kv", 0, 4096)]).wait(10)    # the connection still works


def test_wrong_secret_is_refused_both_ways_and_changes_nothing(remote):
    meta = remote.call("create", "remote", SECRET)
    remote.call("allocate", "kv", MIB)
    with TransferAgent("intruder", b"not-the-secret") as intruder:
        with pytest.raises(AuthenticationError, match="could not prove"):
            intruder.add_peer(meta)
        assert intruder.peers == []
        with pytest.raises(RemoteError, match="AuthenticationError"):
            remote.call("add_peer", intruder.metadata())
        assert remote.call("peers") == []
        with pytest.raises(PeerError):
            intruder.read("remote", [("x", 0, 1)], [("kv", 0, 1)])
    with TransferAgent("local", SECRET) as local:
        local.register("buf", bytearray(MIB))
        assert local.add_peer(meta) == "remote"
        local.read("remote", [("buf", 0, MIB)], [("kv", 0, MIB)]).wait(10)


def test_a_peer_of_another_protocol_is_refused_at_the_handshake(remote):
    """Agents created with another application protocol (another kvhandoff version) do not talk:
    refused from the metadata, and by the server's handshake if the metadata was doctored."""
    meta = remote.call("create", "remote", SECRET, protocol="kvhandoff-handoff/2")
    remote.call("allocate", "kv", MIB)
    with TransferAgent("older", SECRET, protocol="kvhandoff-handoff/1") as older:
        with pytest.raises(PeerError, match="speaks protocol 'kvhandoff-handoff/2'.*'kvhandoff-handoff/1'"):
            older.add_peer(meta)
        doctored = json.dumps({**json.loads(meta), "protocol": "kvhandoff-handoff/1"}).encode()
        with pytest.raises(AuthenticationError, match="speaks protocol 'kvhandoff-handoff/1'.*'kvhandoff-handoff/2'"):
            older.add_peer(doctored)
        assert older.peers == [] and remote.call("peers") == []
    with TransferAgent("same", SECRET, protocol="kvhandoff-handoff/2") as same:
        assert same.add_peer(meta) == "remote"


def test_a_peer_of_another_handshake_version_is_refused_in_words(remote):
    """Version 2 put every frame after the handshake on 64-byte lines; the handshake's own frames did
    not change, so an agent of version 1 is told why instead of reading garbage."""
    import struct
    meta = json.loads(remote.call("create", "remote", SECRET))
    with socket.create_connection(tuple(meta["addr"]), timeout=10) as sock:
        body = json.dumps({"v": 1, "name": "old", "nonce": "00" * 32}).encode()
        sock.sendall(struct.pack("<B3xIQ", 1, 0, len(body)) + body)       # HELLO as version 1 sent it
        kind, _, length = struct.unpack("<B3xIQ", sock.recv(16, socket.MSG_WAITALL))
        reason = json.loads(sock.recv(length, socket.MSG_WAITALL))["reason"]
    assert kind == 5, kind                                                 # REFUSED
    assert "'old' speaks transfer handshake v1, 'remote' speaks v2" in reason
    assert remote.call("peers") == []


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_killed_peer_fails_transfers_and_leaves_no_segments(remote, backend):
    local, _ = make_pair(remote, backend, region_bytes=64 * MIB, peer_timeout_s=5.0)
    with local:
        pid = remote.pid
        assert segments_of(pid)
        blocks = DescList.blocks("kv", range(0, 1024, 2), 64 * KIB)          # 32 MiB, 512 descriptors
        handles = [local.read("remote", blocks, blocks) for _ in range(20)]
        time.sleep(0.05)
        remote.kill()
        t0 = time.monotonic()
        while XferState.ERROR not in [h.state for h in handles]:           # keep reading until it shows
            assert time.monotonic() - t0 < 10, "no transfer failed after the peer was killed"
            handles.append(local.read("remote", blocks, blocks))
            time.sleep(0.01)
        for h in handles:
            try:
                h.wait(10)                                                  # every one finishes: none hangs
            except TransferError as e:
                assert "READ from peer 'remote'" in str(e) and "connection lost" in str(e)
        assert time.monotonic() - t0 < 10
        h = local.read("remote", blocks, blocks)
        assert h.state is XferState.ERROR and "connection lost" in h.error
        deadline = time.monotonic() + 5
        while segments_of(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert segments_of(pid) == []


def test_hung_peer_fails_transfers_within_the_timeout(remote):
    local, _ = make_pair(remote, "tcp", region_bytes=MIB, heartbeat_s=0.2, peer_timeout_s=1.5)
    with local:
        os.kill(remote.pid, signal.SIGSTOP)
        try:
            time.sleep(0.1)
            h = local.read("remote", [("kv", 0, MIB)], [("kv", 0, MIB)])
            with pytest.raises(TransferError, match="READ from peer 'remote'.*no reply"):
                h.wait(10)
            assert h.seconds < 3
        finally:
            os.kill(remote.pid, signal.SIGCONT)


def test_a_connection_that_only_carries_notifications_stays_alive(remote):
    """Notifications get no answer, so a connection busy with nothing else (push keep-alives while a
    long prompt computes) still needs pings: it once died after peer_timeout_s of steady notifications."""
    local, _ = make_pair(remote, "tcp", region_bytes=MIB, heartbeat_s=0.2, peer_timeout_s=1.0)
    with local:
        deadline = time.monotonic() + 3.0           # three peer timeouts
        sent = 0
        while time.monotonic() < deadline:
            local.send_notification("remote", b"progress:%d" % sent)
            sent += 1
            time.sleep(0.05)
        assert "remote" in local.peers
        assert local.read("remote", [("kv", 0, KIB)], [("kv", 0, KIB)]).wait(5).nbytes == KIB
        assert len(remote.call("notifications", sent)) == sent


# ------------------------------------------------------------------------------------------- memory

def test_registered_memory_kinds_and_shm_segments(remote):
    meta = remote.call("create", "remote", SECRET)
    remote.call("allocate", "kv", MIB)
    remote_digest = remote.call("fill", "kv", seed=4)
    with TransferAgent("local", SECRET) as local:
        buffers = {"np": np.zeros(MIB, np.uint8), "ba": bytearray(MIB),
                   "bf16": torch.zeros(MIB // 2, dtype=torch.bfloat16), "f32": torch.zeros(256, 1024, dtype=torch.float32)}
        for name, buf in buffers.items():
            info = local.register(name, buf)
            assert info.nbytes == MIB and info.shm_segment is None
        with pytest.raises(TypeError, match="contiguous"):
            local.register("t", torch.zeros(64, 64).t())
        with pytest.raises(TypeError, match="read-only"):
            local.register("ro", b"abc")
        assert local.add_peer(meta) == "remote" and local.peer_backend("remote") == "shm"
        for name in buffers:                               # private memory works as the local end of shm
            h = local.read("remote", [(name, 0, MIB)], [("kv", 0, MIB)]).wait(10)
            assert h.backend == "shm"
        assert digest(np.frombuffer(buffers["ba"], np.uint8)) == remote_digest
        assert digest(buffers["bf16"].view(torch.uint8).numpy()) == remote_digest

        kv = local.allocate_region("pool", 2 * MIB)
        segment = local.regions["pool"].shm_segment
        path = os.path.join(SHM_DIR, segment)
        assert kv.dtype == torch.uint8 and kv.numel() == 2 * MIB
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.stat(path).st_uid == os.geteuid()
        sub = kv[MIB:]                                       # a view into a segment is shm-backed too
        assert local.register("pool-hi", sub).shm_segment == segment
        local.deregister("pool")
        assert os.path.exists(path)                          # still backs 'pool-hi'
        local.deregister("pool-hi")
        assert not os.path.exists(path)
        local.allocate_region("again", MIB)
        again = os.path.join(SHM_DIR, local.regions["again"].shm_segment)
    assert not os.path.exists(again)                         # close() unlinks


def test_deregistered_region_is_refused(remote):
    local, _ = make_pair(remote, "tcp", region_bytes=MIB)
    with local:
        grants = local._peers["remote"].grants
        remote.call("allocate", "extra", MIB)
        wait_until(lambda: "extra" in local._peers["remote"].grants)     # grants update over the connection
        local.read("remote", [("kv", 0, 4096)], [("extra", 0, 4096)]).wait(10)
        stale = local._peers["remote"].grants
        remote.call("deregister", "extra")
        wait_until(lambda: "extra" not in local._peers["remote"].grants)
        with pytest.raises(OutOfBoundsError, match="'extra' is not registered"):
            local.read("remote", [("kv", 0, 4096)], [("extra", 0, 4096)])
        local._peers["remote"].grants = stale                           # pretend we missed the update
        with pytest.raises(TransferError, match="region id .* is not registered"):
            local.read("remote", [("kv", 0, 4096)], [("extra", 0, 4096)]).wait(10)
        assert "extra" not in grants


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_stale_segments_of_dead_processes_are_swept():
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(child.stdout)
    pidns = os.stat("/proc/self/ns/pid").st_ino
    stale = os.path.join(SHM_DIR, f"kvh.{pidns}.{dead_pid}.12345.crashed.kv.abcd")
    mine = os.path.join(SHM_DIR, f"kvh.{pidns}.{os.getpid()}.1.not-really-me.abcd")
    for path in (stale, mine):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        removed = sweep_stale_segments()
        assert os.path.basename(stale) in removed and not os.path.exists(stale)
        assert os.path.basename(mine) in removed             # our pid, but another start time: a reused pid
    finally:
        for path in (stale, mine):
            if os.path.exists(path):
                os.unlink(path)


def test_agent_lifecycle_guards():
    with pytest.raises(ValueError, match="secret"):
        TransferAgent("x", b"")
    with pytest.raises(ValueError, match="advertise_host"):
        TransferAgent("x", SECRET, listen_host="0.0.0.0")
    agent = TransferAgent("x", SECRET)
    assert SECRET not in agent.metadata() and b"127.0.0.1" in agent.metadata()
    got = []
    waiter = threading.Thread(target=lambda: got.append(agent.wait_notification()))
    waiter.start()
    time.sleep(0.1)
    agent.close()
    waiter.join(5)
    assert got == [None] and not waiter.is_alive()           # close() wakes a blocked waiter
    with pytest.raises(TransferError, match="closed"):
        agent.register("r", bytearray(10))
    agent.close()                                             # idempotent


HUGE_TMPFS_PROBE = """
import json, subprocess, sys
from kvhandoff.transfer.huge_tmpfs import private_huge_tmpfs
from kvhandoff.transfer.memory import create_segment, huge_page_share
shm = private_huge_tmpfs()
out = {"path": shm.path, "huge": shm.huge, "mounted": shm.mounted, "why": shm.why}
if shm.mounted:
    segment = create_segment("probe", 8 << 20, shm.path)
    segment.array[:] = 1
    out["huge_share"] = huge_page_share(segment.array)
    out["child_sees"] = subprocess.run(["ls", shm.path], capture_output=True, text=True).stdout.split()
print(json.dumps(out), flush=True)
sys.stdin.readline()
shm.close()
"""


@pytest.mark.parametrize("privileged", [True, False], ids=["may-mount", "may-not-mount"])
def test_a_private_huge_page_tmpfs_is_seen_by_our_children_only(privileged):
    """Where /dev/shm gives 4 KiB pages, private_huge_tmpfs mounts a huge-page tmpfs that the caller
    and its children see, nobody else does, and is gone once closed; without CAP_SYS_ADMIN it says
    why and keeps /dev/shm."""
    if tmpfs_huge(SHM_DIR):
        pytest.skip(f"{SHM_DIR} gives huge pages itself")
    if privileged and not may_mount():
        pytest.skip("this test process may not mount filesystems")
    drop = [] if privileged else ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]
    if drop and shutil.which("setpriv") is None:
        pytest.skip("no setpriv to drop capabilities with")
    probe = subprocess.Popen([*drop, sys.executable, "-c", HUGE_TMPFS_PROBE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        got = json.loads(probe.stdout.readline())
        if not privileged or not may_mount():
            assert (got["path"], got["huge"], got["mounted"]) == (SHM_DIR, False, False), got
            assert "may not mount" in got["why"] and "huge=within_size" in got["why"], got
        else:
            assert got["huge"] and got["mounted"] and got["huge_share"] == 1.0, got
            assert [name.split(".")[-2] for name in got["child_sees"]] == ["probe"], got
            assert os.listdir(got["path"]) == []        # out here an empty directory
        probe.stdin.write("\n")
        probe.stdin.flush()
        assert probe.wait(30) == 0
    finally:
        probe.kill()
    assert os.path.exists(got["path"]) == (got["path"] == SHM_DIR)


def test_segments_in_another_directory(remote, tmp_path):
    # shm_dir lets operators put regions on a tmpfs with huge pages; any directory both can open works.
    meta = remote.call("create", "remote", SECRET, shm_dir=str(tmp_path))
    remote.call("allocate", "kv", MIB)
    original = remote.call("fill", "kv", seed=8)
    with TransferAgent("local", SECRET, shm_dir=str(tmp_path)) as local:
        kv = local.allocate_region("kv", MIB).numpy()
        files = sorted(os.listdir(tmp_path))
        assert len(files) == 2 and all(stat.S_IMODE(os.stat(tmp_path / f).st_mode) == 0o600 for f in files)
        local.add_peer(meta)
        assert local.read("remote", [("kv", 0, MIB)], [("kv", 0, MIB)]).wait(10).backend == "shm"
        assert digest(kv) == original
    remote.close()
    assert os.listdir(tmp_path) == []


def test_garbage_on_the_wire_is_refused_and_harmless():
    import json
    import socket
    with TransferAgent("a", SECRET) as a, TransferAgent("b", SECRET) as b:
        huge_hello = (1).to_bytes(1, "little") + bytes(7) + (2**40).to_bytes(8, "little")
        for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", np.random.default_rng(0).bytes(64), huge_hello):
            with socket.create_connection(b.address, timeout=5) as s:
                s.sendall(junk)
                try:
                    assert s.recv(100) == b""                        # the server just hangs up
                except ConnectionResetError:
                    pass
        assert a.add_peer(b.metadata()) == "b"                        # and still serves real peers
        # Our side of the same: an "agent" that answers with junk is refused with a clear error.
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=lambda: listener.accept()[0].sendall(b"HTTP/1.1 400 Bad\r\n\r\n" * 4),
                         daemon=True).start()
        fake = json.dumps({"v": 1, "name": "fake", "addr": ["127.0.0.1", listener.getsockname()[1]]}).encode()
        with pytest.raises(PeerError, match="handshake with peer 'fake' failed"):
            a.add_peer(fake)
        with pytest.raises(PeerError, match="malformed"):
            a.add_peer(b"{not json")
        assert a.peers == ["b"]
        listener.close()


def test_bench_transfer_command_writes_the_documented_json(tmp_path):
    import json
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "bench-transfer", "--backends", "shm,tcp",
                           "--total-mb", "4", "--repeats", "1", "--latency-iters", "20", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sendmsg" in proc.stdout and "x memcpy" in proc.stdout and "load avg" in proc.stdout
    report = json.loads(out.read_text())
    assert set(report["memcpy_gbps"]) == set(report["sendmsg_gbps"]) == {"16384", "262144", "4194304"}
    rows = {(r["backend"], r["op"], r["block_bytes"]) for r in report["results"]}
    assert rows == {(b, op, size) for b in ("shm", "tcp") for op in ("read", "write")
                    for size in (4096, 16384, 262144, 4194304)}
    assert all(r["gbps"] > 0 and 0 < r["p50_us"] <= r["p99_us"] for r in report["results"])
    assert len(report["loadavg_before"]) == 3


def resident_bytes(array: np.ndarray) -> int:
    """The Rss of the mapping that holds `array`, from /proc/self/smaps."""
    address, inside = array.ctypes.data, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the array")


@pytest.mark.parametrize("kernel", ["with MADV_POPULATE_WRITE", "without it"])
def test_a_segment_is_mapped_in_before_its_first_use(kernel, monkeypatch):
    """A first touch of a tmpfs page costs a minor fault (~0.45 ms a MiB here, paid by the prefill's
    compute or a copy on the request's path): every mapping, ours and a peer's, is populated at once in
    the background (on a kernel before 5.14, which refuses the advice, by reading every page)."""
    if kernel == "without it":
        monkeypatch.setattr(pages, "MADV_POPULATE_WRITE", 9999)     # an advice every kernel refuses
    nbytes = 8 << 20
    ours = create_segment("prefault-test", nbytes)
    try:
        theirs = open_segment(ours.directory, ours.name, ours.dev_ino, nbytes)
        deadline = time.monotonic() + 10
        while min(resident_bytes(ours.array), resident_bytes(theirs.array)) < nbytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert resident_bytes(ours.array) == resident_bytes(theirs.array) == nbytes
        assert not ours.array.any()         # populating wrote nothing
    finally:
        ours.unlink()


def test_scatter_receive_fills_small_and_large_buffers_in_order():
    """recv_into_buffers: buffers under LARGE_RECV share a recvmsg_into, larger ones get recv_into calls
    of their own; the bytes land in order however the sender cuts them, and a peer that closes halfway
    through a large buffer is a ConnectionLost, not a short read."""
    sizes = [3, LARGE_RECV - 1, LARGE_RECV, 5, 2 * LARGE_RECV + 11, 7, 7]
    payload = np.random.default_rng(5).integers(0, 256, sum(sizes), dtype=np.uint8).tobytes()
    a, b = socket.socketpair()
    with a, b:
        def trickle():
            for i in range(0, len(payload), 40_000):      # pieces that cut across every buffer edge
                a.sendall(payload[i:i + 40_000])
        sender = threading.Thread(target=trickle)
        sender.start()
        buffers = [bytearray(n) for n in sizes]
        recv_into_buffers(b, (memoryview(x) for x in buffers))
        sender.join()
        assert b"".join(buffers) == payload
        a.sendall(payload[:LARGE_RECV // 2])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionLost):
            recv_into_buffers(b, [memoryview(bytearray(LARGE_RECV))])
