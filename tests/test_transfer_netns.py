"""The tcp backend between two network namespaces joined by a veth pair: two agents on real
addresses (198.18.0.0/15, the benchmarking range), as two hosts would be, with the bytes checked
and the traffic seen on the veth counters."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from kvhandoff.transfer.remote import RemoteAgent

pytestmark = pytest.mark.timeout(120)
SECRET = b"netns-secret-0123456789"
MIB = 1 << 20
ADDR_A, ADDR_B = "198.18.0.1", "198.18.0.2"


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is not installed")
    tag = str(os.getpid() % 100000)
    ns_a, ns_b, veth_a, veth_b = f"kvh-a-{tag}", f"kvh-b-{tag}", f"kvha{tag}", f"kvhb{tag}"
    try:
        ip("netns", "add", ns_a)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
    try:
        ip("netns", "add", ns_b)
        ip("link", "add", veth_a, "netns", ns_a, "type", "veth", "peer", "name", veth_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, veth_a, ADDR_A), (ns_b, veth_b, ADDR_B)):
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield (ns_a, veth_a), (ns_b, veth_b)
    finally:
        for ns in (ns_a, ns_b):                   # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def scattered(rng: np.random.Generator, sizes: list[int]) -> list[int]:
    """Offsets for ranges of `sizes` in random order with a gap after each, so none coalesce."""
    offsets, pos = [0] * len(sizes), 0
    for k in rng.permutation(len(sizes)).tolist():
        offsets[k], pos = pos, pos + sizes[k] + 512
    return offsets


def veth_bytes(ns: str, dev: str) -> tuple[int, int]:
    stats = json.loads(ip("-n", ns, "-s", "-j", "link", "show", dev))[0]["stats64"]
    return stats["rx"]["bytes"], stats["tx"]["bytes"]


def test_tcp_between_two_network_namespaces(two_hosts):
    (ns_a, veth_a), (ns_b, _) = two_hosts
    host_a = RemoteAgent(prefix=["ip", "netns", "exec", ns_a])
    host_b = RemoteAgent(prefix=["ip", "netns", "exec", ns_b])
    try:
        meta_b = host_b.call("create", "host-b", SECRET, backend="tcp", listen_host=ADDR_B)
        host_a.call("create", "host-a", SECRET, backend="tcp", listen_host=ADDR_A)
        assert json.loads(meta_b)["addr"][0] == ADDR_B
        for host in (host_a, host_b):
            host.call("allocate", "kv", 16 * MIB)
        assert host_a.call("add_peer", meta_b) == "host-b"

        sizes = [1024, 4096, 65536, 1 * MIB, 3 * MIB + 5, 8 * MIB] + [16384] * 64
        local = list(zip(["kv"] * len(sizes), scattered(np.random.default_rng(1), sizes), sizes))
        remote = list(zip(["kv"] * len(sizes), scattered(np.random.default_rng(2), sizes), sizes))
        rx_before, _ = veth_bytes(ns_a, veth_a)

        host_b.call("fill", "kv", seed=1)
        got = host_a.call("xfer", "read", "host-b", local, remote, b"read-done")
        assert got["error"] is None and got["backend"] == "tcp" and got["wire_descs"] == len(sizes)
        assert host_a.call("digest", "kv", local) == host_b.call("digest", "kv", remote)

        host_a.call("fill", "kv", seed=2)
        got = host_a.call("xfer", "write", "host-b", local, remote, b"write-done")
        assert got["error"] is None
        assert host_b.call("digest", "kv", remote) == host_a.call("digest", "kv", local)
        assert host_b.call("notifications", 2) == [("host-a", b"read-done"), ("host-a", b"write-done")]

        rx_after, _ = veth_bytes(ns_a, veth_a)
        assert rx_after - rx_before >= sum(sizes)               # the READ really crossed the veth
    finally:
        host_a.close()
        host_b.close()
