"""A TransferAgent in a separate process, driven over its stdin/stdout: the far side of the
two-process tests and of `kvhandoff bench-transfer`, and, started under `ip netns exec`, an agent on
another (virtual) host.

The parent sends length-prefixed pickled calls and gets pickled results back; the child's own
stdout is moved to stderr first, so nothing it prints can corrupt the stream. The child exits when
its stdin closes, so it never outlives the parent.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import select
import struct
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

_LEN = struct.Struct("<Q")


class RemoteError(RuntimeError):
    """The call raised in the child; the message carries its type and text."""


def digest(array: np.ndarray, descs: Sequence[tuple[str, int, int]] | None = None) -> str:
    """sha256 of the bytes `descs` name in a flat uint8 array, in order (all of it if None)."""
    h = hashlib.sha256()
    for _, offset, length in descs or [("", 0, array.nbytes)]:
        h.update(memoryview(array[offset:offset + length]))
    return h.hexdigest()


class RemoteAgent:
    def __init__(self, prefix: Sequence[str] = (), stderr=None):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "kvhandoff.transfer.remote"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, method: str, *args, timeout: float = 60.0, **kwargs):
        payload = pickle.dumps((method, args, kwargs))
        self.proc.stdin.write(_LEN.pack(len(payload)) + payload)
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        (n,) = _LEN.unpack(self._read(_LEN.size, deadline, method))
        ok, value = pickle.loads(self._read(n, deadline, method))
        if not ok:
            raise RemoteError(value)
        return value

    def _read(self, n: int, deadline: float, method: str) -> bytes:
        fd, out = self.proc.stdout.fileno(), bytearray()
        while len(out) < n:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError(f"remote agent (pid {self.pid}) did not answer {method!r} in time")
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise RemoteError(f"remote agent (pid {self.pid}) exited during {method!r} "
                                  f"(status {self.proc.poll()})")
            out += chunk
        return bytes(out)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=timeout)
            except (RemoteError, TimeoutError, OSError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def __enter__(self) -> RemoteAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Host:
    """What the parent may call in the child: one agent and the byte arrays of its regions."""

    def __init__(self):
        self.agent = None
        self.arrays: dict[str, np.ndarray] = {}
        self.running = True

    def create(self, name: str, secret: bytes, **kwargs) -> bytes:
        from kvhandoff.transfer import TransferAgent
        self.agent = TransferAgent(name, secret, **kwargs)
        return self.agent.metadata()

    def allocate(self, region: str, nbytes: int) -> str | None:
        self.arrays[region] = self.agent._allocate(region, nbytes)
        return self.agent.regions[region].shm_segment

    def deregister(self, region: str) -> None:
        self.agent.deregister(region)
        del self.arrays[region]

    def fill(self, region: str, seed: int) -> str:
        arr = self.arrays[region]
        arr[:] = np.random.default_rng(seed).integers(0, 256, arr.size, dtype=np.uint8)
        return digest(arr)

    def digest(self, region: str, descs=None) -> str:
        return digest(self.arrays[region], descs)

    def add_peer(self, metadata: bytes) -> str:
        return self.agent.add_peer(metadata)

    def xfer(self, op: str, peer: str, local, remote, notify: bytes | None = None, timeout: float = 60.0) -> dict:
        handle = getattr(self.agent, op)(peer, local, remote, notify)
        try:
            handle.wait(timeout)
        except Exception as e:
            return {"state": handle.state.value, "error": str(e), "wire_descs": handle.wire_descs}
        return {"state": handle.state.value, "error": None, "wire_descs": handle.wire_descs,
                "backend": handle.backend, "seconds": handle.seconds}

    def notifications(self, count: int = 1, timeout: float = 10.0) -> list[tuple[str, bytes]]:
        notes, deadline = [], time.monotonic() + timeout
        while len(notes) < count and (note := self.agent.wait_notification(max(0.0, deadline - time.monotonic()))):
            notes.append(note)
        return notes

    def send_notification(self, peer: str, msg: bytes) -> None:
        self.agent.send_notification(peer, msg)

    def peers(self) -> list[str]:
        return self.agent.peers

    def stream_serve(self, total: int, block: int, region: str | None = None) -> int:
        from kvhandoff.transfer.bench import serve_stream
        return serve_stream(total, block, None if region is None else self.arrays[region])

    def exit(self) -> None:
        if self.agent is not None:
            self.agent.close()
        self.running = False


def _serve(inp, out) -> None:
    host = _Host()
    while host.running:
        head = inp.read(_LEN.size)
        if len(head) < _LEN.size:
            break
        method, args, kwargs = pickle.loads(inp.read(_LEN.unpack(head)[0]))
        try:
            if method.startswith("_") or not callable(getattr(_Host, method, None)):
                raise AttributeError(f"no remote method {method!r}")
            result = (True, getattr(host, method)(*args, **kwargs))
        except Exception as e:
            result = (False, f"{type(e).__name__}: {e}")
        payload = pickle.dumps(result)
        out.write(_LEN.pack(len(payload)) + payload)
        out.flush()
    if host.agent is not None:
        host.agent.close()


if __name__ == "__main__":
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                       # stray prints go to stderr, never into the result stream
    _serve(sys.stdin.buffer, protocol_out)
