"""The nixl backend: READ/WRITE mapped onto NVIDIA NIXL's nixl_agent (UCX), when the optional `nixl`
package is importable (`pip install kvhandoff[nixl]`).

Our control connection still authenticates the peer, carries NIXL's agent metadata (so it is only
ever loaded from a peer that proved the secret), bounds-checks descriptors against the peer's grants
and watches liveness; NIXL moves the bytes and delivers the notifications. nixl_agent is created
without a listener thread (we exchange metadata ourselves) and is not thread-safe in that mode, so
every call goes through one lock.
"""
from __future__ import annotations

import base64
import threading
from collections.abc import Callable

import numpy as np

from kvhandoff.transfer.errors import TransferError
from kvhandoff.transfer.handle import Op
from kvhandoff.transfer.memory import Region


def unavailable_reason() -> str | None:
    """None if nixl can be used here, else why not (for error messages and test skips)."""
    try:
        import nixl._api  # noqa: F401
    except Exception as e:          # ImportError, or a native library that fails to load
        return f"the nixl package is not importable ({type(e).__name__}: {e}); pip install 'kvhandoff[nixl]'"
    return None


class NixlEngine:
    def __init__(self, name: str, on_notify: Callable[[str, bytes], None]):
        reason = unavailable_reason()
        if reason is not None:
            raise TransferError(reason)
        from nixl._api import nixl_agent, nixl_agent_config
        # NIXL's own progress thread polls without pause (its Python API fixes the delay at 0) and
        # so burns a whole core even when idle: on a 2-core host that starved every other
        # measurement. We drive UCX ourselves instead (below): calls into the agent make progress.
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._lock = threading.Lock()
        self._registered: dict[str, object] = {}        # region name -> NIXL registration descriptors
        self._remotes: dict[str, str] = {}              # our peer name -> NIXL's name for it
        self._loaded: dict[str, str] = {}               # our peer name -> the metadata loaded for it
        self._on_notify = on_notify
        self._in_flight = 0
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, name=f"kvh-nixl-{name}", daemon=True)
        self._progress.start()

    def _progress_loop(self) -> None:
        """Progress connection setup and notifications for both sides of a transfer: every 0.1 ms
        while anything happened lately, every 2 ms when idle (a few % of a core, not all of it)."""
        quiet = 0
        while not self._stop.wait(1e-4 if quiet < 200 else 2e-3):
            notes = self.notifications()
            for note in notes:
                self._on_notify(*note)
            quiet = 0 if notes or self._in_flight else quiet + 1

    def metadata(self) -> str:
        with self._lock:
            return base64.b64encode(self._agent.get_agent_metadata()).decode()

    def register(self, region: Region) -> None:
        with self._lock:
            self._registered[region.name] = self._agent.register_memory([(region.addr, region.nbytes, 0, "")], "DRAM")

    def deregister(self, region: Region) -> None:
        with self._lock:
            descs = self._registered.pop(region.name, None)
            if descs is not None:
                self._agent.deregister_memory(descs)

    def load_remote(self, peer: str, metadata_b64: str) -> None:
        """(Re)load a peer's NIXL metadata; new registrations on its side need a reload to be reachable."""
        with self._lock:
            if self._loaded.get(peer) == metadata_b64:
                return                                  # unchanged: keep transfers in flight undisturbed
            if peer in self._remotes:
                self._agent.remove_remote_agent(self._remotes.pop(peer))
            name = self._agent.add_remote_agent(base64.b64decode(metadata_b64))
            self._remotes[peer] = name.decode() if isinstance(name, bytes) else name
            self._loaded[peer] = metadata_b64

    def remove_remote(self, peer: str) -> None:
        with self._lock:
            self._loaded.pop(peer, None)
            if peer in self._remotes:
                self._agent.remove_remote_agent(self._remotes.pop(peer))

    def has_remote(self, peer: str) -> bool:
        return peer in self._remotes

    def post(self, op: Op, peer: str, local_addrs: np.ndarray, remote_addrs: np.ndarray, lengths: np.ndarray,
             notify: bytes):
        """Start a transfer; returns NIXL's handle. Addresses are absolute, already bounds-checked."""
        local = np.stack([local_addrs, lengths, np.zeros_like(lengths)], axis=1).astype(np.uint64)
        remote = np.stack([remote_addrs, lengths, np.zeros_like(lengths)], axis=1).astype(np.uint64)
        with self._lock:
            xfer = self._agent.initialize_xfer(op.name, self._agent.get_xfer_descs(local, "DRAM"),
                                               self._agent.get_xfer_descs(remote, "DRAM"),
                                               self._remotes[peer], notify)
            state = self._agent.transfer(xfer)
            self._in_flight += 1
        return xfer, state

    def send(self, peer: str, msg: bytes) -> None:
        with self._lock:
            self._agent.send_notif(self._remotes[peer], msg)

    def check(self, xfer) -> str:
        """'PROC', 'DONE' or 'ERR'."""
        with self._lock:
            return self._agent.check_xfer_state(xfer)

    def release(self, xfer) -> None:
        with self._lock:
            self._agent.release_xfer_handle(xfer)
            self._in_flight -= 1

    def notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            notes = self._agent.get_new_notifs()
        by_nixl_name = {v: k for k, v in self._remotes.items()}
        return [(by_nixl_name.get(name, name), msg) for name, msgs in notes.items() for msg in msgs]

    def close(self) -> None:
        self._stop.set()
        self._progress.join(1.0)
        with self._lock:
            calls = [(self._agent.remove_remote_agent, name) for name in self._remotes.values()]
            calls += [(self._agent.deregister_memory, descs) for descs in self._registered.values()]
            self._remotes.clear()
            self._loaded.clear()
            self._registered.clear()
            for call, arg in calls:
                try:
                    call(arg)
                except Exception:                       # best effort: the process may be exiting
                    pass
