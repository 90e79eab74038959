"""An emulated network link between the prefill and the decode side of a stack on one machine
(`kvhandoff up --link RATE[,DELAY[,JITTER]]`), so that moving the KV costs what it would between two
hosts: the decode workers run in a network namespace of their own, joined to this one by a veth pair
whose two ends are shaped alike, each direction: by `tc netem` (rate, delay, jitter) where the
kernel has it, else by a token bucket (`tbf`: rate only; a delay then is refused with a message, not
ignored). The prefill workers and the router stay here, on the near end's address; KV goes over the
tcp backend.

Addresses come from 198.18.0.0/15 (RFC 2544, for benchmarks), a /30 per stack chosen by its pid. The
namespace, the veth pair (and with them the qdiscs and the near end's address) are removed when the
stack stops, Ctrl-C and SIGTERM included; a stack killed outright leaves its namespace, which the
next `--link` stack removes once it sees that the pid in its name is gone.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

NS_PREFIX = "kvh-link-"
BENCH_NET = ipaddress.ip_network("198.18.0.0/15")
# tc's rate units (bits per second); "bps" style byte units are not accepted here, to avoid a factor 8.
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
TIME = re.compile(r"^\d+(\.\d+)?(s|ms|us)$")


class LinkError(RuntimeError):
    """The link cannot be set up here (not root, no iproute2, no namespaces): says what is missing."""


@dataclass(frozen=True)
class LinkSpec:
    rate: str                      # tc's spelling: "10gbit", "200mbit"
    delay: str | None = None       # one way, each direction: "50us", "1ms"
    jitter: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LinkSpec":
        """'1gbit,50us[,10us]' -> LinkSpec; ValueError naming what is wrong."""
        parts = [p.strip().lower() for p in text.split(",")]
        if not 1 <= len(parts) <= 3 or not parts[0]:
            raise ValueError(f"--link {text!r}: expected RATE[,DELAY[,JITTER]], e.g. 1gbit,50us")
        spec = cls(*parts)
        spec.bits_per_s                      # (raises ValueError for a rate tc would not take)
        for name, value in (("delay", spec.delay), ("jitter", spec.jitter)):
            if value is not None and not TIME.match(value):
                raise ValueError(f"--link {text!r}: {name} {value!r} is not a time like 50us, 2ms or 0.1s")
        if spec.jitter and not spec.delay:
            raise ValueError(f"--link {text!r}: jitter needs a delay")
        return spec

    @property
    def bits_per_s(self) -> float:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", self.rate)
        if not m or m[2] not in RATE_UNITS or float(m[1]) <= 0:
            raise ValueError(f"--link rate {self.rate!r} is not a rate like 10gbit, 200mbit or 500kbit")
        return float(m[1]) * RATE_UNITS[m[2]]

    def netem(self) -> list[str]:
        args = ["netem", "rate", self.rate]
        if self.delay:
            args += ["delay", self.delay, *([self.jitter] if self.jitter else [])]
        # A queue deep enough for a fast link's bandwidth-delay product: netem drops past `limit` packets.
        return args + ["limit", "100000"]

    def tbf(self) -> list[str]:
        """The rate alone, as a token bucket: a burst of 4 ms at the rate (at least 64 KiB, a GSO
        packet: veth hands tc packets that large) and up to a second of queue before it drops."""
        burst = max(64 * 1024, int(self.bits_per_s / 8 * 0.004))
        return ["tbf", "rate", self.rate, "burst", str(burst), "latency", "1s"]

    def __str__(self) -> str:
        return ",".join(p for p in (self.rate, self.delay, self.jitter) if p)


def run(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout
    except subprocess.CalledProcessError as exc:
        raise LinkError(f"`{' '.join(cmd)}` failed: {exc.stderr.strip() or exc.returncode}") from None


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmulatedLink:
    """The decode side's namespace and the shaped veth pair to it (up, then down, once each)."""

    def __init__(self, spec: LinkSpec, owner: int | None = None):
        self.spec, self.owner = spec, owner or os.getpid()
        tag = str(self.owner)
        self.ns = NS_PREFIX + tag
        self.near_dev, self.far_dev = f"kvhl{tag}n", f"kvhl{tag}f"        # IFNAMSIZ: at most 15 characters
        base = BENCH_NET.network_address + 4 * (self.owner % (BENCH_NET.num_addresses // 4))
        self.near_addr, self.far_addr = str(base + 1), str(base + 2)       # a /30 of its own
        self.created = False
        self.shaper: str | None = None       # netem or tbf, once up

    @property
    def prefix(self) -> list[str]:
        """Run a command on the far side: prefix its argv with this."""
        return ["ip", "netns", "exec", self.ns]

    def up(self) -> None:
        check_available()
        sweep_stale()
        self.created = True                  # from the first command on, down() cleans up
        try:
            run("ip", "netns", "add", self.ns)
            run("ip", "link", "add", self.near_dev, "type", "veth", "peer", "name", self.far_dev, "netns", self.ns)
            run("ip", "addr", "add", f"{self.near_addr}/30", "dev", self.near_dev)
            run("ip", "link", "set", self.near_dev, "up")
            run("ip", "-n", self.ns, "addr", "add", f"{self.far_addr}/30", "dev", self.far_dev)
            run("ip", "-n", self.ns, "link", "set", self.far_dev, "up")
            run("ip", "-n", self.ns, "link", "set", "lo", "up")
            qdisc = self.qdisc()
            run("tc", "qdisc", "add", "dev", self.near_dev, "root", *qdisc)
            run("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.far_dev, "root", *qdisc)
        except BaseException:
            self.down()
            raise

    def qdisc(self) -> list[str]:
        """netem's arguments if this kernel has netem (tried on the far end, which is ours), else tbf's."""
        try:
            run("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.far_dev, "root", *self.spec.netem())
        except LinkError as exc:
            if "unknown" not in str(exc).lower():
                raise
            if self.spec.delay:
                raise LinkError(f"this kernel has no netem qdisc (sch_netem), which a link delay needs; "
                                f"emulate the rate alone (--link {self.spec.rate}) or run where netem exists") from None
            self.shaper = "tbf"
            return self.spec.tbf()
        run("ip", "netns", "exec", self.ns, "tc", "qdisc", "del", "dev", self.far_dev, "root")
        self.shaper = "netem"
        return self.spec.netem()

    def down(self) -> None:
        """Remove the namespace: its veth end goes with it, and so does the pair's near end, with the
        qdiscs and the address. Idempotent."""
        if self.created:
            remove(self.ns, self.near_dev)
            self.created = False

    def describe(self) -> str:
        return (f"emulated link {self.spec} ({self.shaper}) between {self.near_addr} (prefill workers, router) "
                f"and {self.far_addr} (decode workers, namespace {self.ns})")


def check_available() -> None:
    if os.geteuid() != 0:
        raise LinkError("an emulated link needs root (it creates a network namespace and shapes a veth pair "
                        "with tc); run as root or drop --link")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(f"an emulated link needs iproute2's {' and '.join(missing)} (Debian: apt-get install "
                        "iproute2); or drop --link")


def remove(ns: str, near_dev: str) -> None:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", near_dev], capture_output=True, timeout=30)    # (if the pair outlived it)


def sweep_stale() -> None:
    """Namespaces of `--link` stacks whose process is gone (killed outright): removed."""
    for ns in namespaces():
        owner = ns.removeprefix(NS_PREFIX)
        if ns.startswith(NS_PREFIX) and owner.isdigit() and not pid_alive(int(owner)):
            stale = EmulatedLink(LinkSpec("1gbit"), int(owner))
            remove(stale.ns, stale.near_dev)
