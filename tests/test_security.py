"""Security defaults (issue 7): every listener a worker or a router opens (HTTP and the KV agent) is
bound to loopback unless an address is asked for, and the deployment secret never reaches a log, even
at debug level with a handoff done. The other security guarantees are shown next to the
code they test: a peer without the secret cannot attach and a descriptor outside the grant is refused
(test_transfer.py: test_wrong_secret_is_refused_both_ways_and_changes_nothing,
test_out_of_bounds_is_refused_and_changes_nothing, test_deregistered_region_is_refused), control
endpoints refuse requests without the deployment's token (test_handoff.py:
test_handoffs_need_the_control_token), and hostile bodies never get a 5xx (test_fuzz.py)."""
from __future__ import annotations

import os
import socket

import httpx

from conftest import start_servers
from kvhandoff.wire.auth import control_token
from test_handoff import COMMON, SECRET
from test_router import ROUTER_READY, Proc

TCP_LISTEN = "0A"


def listening_addresses(pid: int) -> list[str]:
    """'ip:port' of every TCP socket in LISTEN state that process `pid` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != TCP_LISTEN or inode not in inodes:
                continue
            hex_ip, hex_port = local.split(":")
            raw = bytes.fromhex(hex_ip)
            if family == socket.AF_INET:
                raw = raw[::-1]                         # /proc shows IPv4 as a little-endian word
            else:
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
            found.append(f"{socket.inet_ntop(family, raw)}:{int(hex_port, 16)}")
    return found


def test_listeners_default_to_loopback_and_logs_hold_no_secret(tmp_path):
    debug = ["--log-level", "debug"]
    workers, router = [], None
    try:
        workers = start_servers([([*COMMON, "--role", role, *debug], tmp_path / f"{role}.log")
                                 for role in ("prefill", "decode")])
        router = Proc(["router", "--prefill", workers[0].url, "--decode", workers[1].url, "--mode", "pull",
                       "--port", "0", "--kv-secret", SECRET, *debug], tmp_path / "router.log", ROUTER_READY)
        r = httpx.post(router.url + "/v1/completions", timeout=60,
                       json={"prompt": "a handoff, so the handshake and control calls all run", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["handoff"]["bytes_transferred"] > 0, r.text
        for pid, least in [(w.proc.pid, 2) for w in workers] + [(router.proc.pid, 1)]:   # worker: HTTP + KV agent
            addresses = listening_addresses(pid)
            assert len(addresses) >= least, addresses
            assert all(a.startswith(("127.0.0.1:", "::1:")) for a in addresses), addresses
    finally:
        if router is not None:
            router.stop()
        for worker in workers:
            worker.stop()
    for log in tmp_path.glob("*.log"):
        text = log.read_text(errors="replace")
        assert "DEBUG" in text or log.name == "router.log", f"{log.name}: not at debug level after all?"
        assert SECRET not in text and control_token(SECRET) not in text, f"the secret (or its token) is in {log.name}"
