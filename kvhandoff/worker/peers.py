"""The other workers' agents this worker's agent is connected to: found by the metadata a handoff
names (one handshake per peer, however many first requests race for it), watched for their death,
and the READs and WRITEs to them."""
from __future__ import annotations

import base64
import json
import threading
from typing import Callable

from kvhandoff.transfer.agent import TransferAgent
from kvhandoff.transfer.errors import PeerError
from kvhandoff.worker.chores import Chores
from kvhandoff.worker.errors import HandoffError


class Peers:
    def __init__(self, agent: TransferAgent, chores: Chores):
        self.agent, self.chores = agent, chores
        self._lost: list[Callable[[str, str], None]] = []
        self._locks: dict[str, threading.Lock] = {}
        self._names: dict[str, str] = {}            # agent metadata (base64) -> its name, once connected
        self._lock = threading.Lock()

    def on_lost(self, handler: Callable[[str, str], None]) -> None:
        """Call `handler(peer, reason)` when a peer's connection dies (register before start)."""
        self._lost.append(handler)

    def start(self) -> None:
        self.agent.on_peer_lost = self._peer_lost

    def close(self) -> None:
        """(The agent is closed by its owner, last: it holds the KV pool.)"""

    def _peer_lost(self, peer: str, reason: str) -> None:
        for handler in self._lost:
            handler(peer, reason)

    def alive(self, peer: str | None) -> bool:
        return peer is not None and peer in self.agent.peers

    async def peer(self, metadata_b64: str) -> str:
        """The connected agent `metadata_b64` describes (asyncio): a known one at once, a new one after
        its handshake on an executor thread. (Every handoff names its peer: the hop to a thread and back
        cost each one a thread wake-up and two GIL hand-offs, on the prefill's own core, while its
        prompt computed.)"""
        return self.known(metadata_b64) or await self.chores.blocking(self.connect, metadata_b64)

    def known(self, metadata_b64: str) -> str | None:
        """The agent `metadata_b64` describes, if we are connected to it already (any thread)."""
        name = self._names.get(metadata_b64)
        return name if name is not None and name in self.agent.peers else None

    def connect(self, metadata_b64: str) -> str:
        """Connect to (and authenticate) the agent described by `metadata_b64`. Blocking: call it
        from a thread that may wait, never the engine thread. Concurrent first requests to one peer
        wait for a single handshake: a second add_peer would replace the connection and fail its
        transfers."""
        try:
            metadata = base64.b64decode(metadata_b64, validate=True)
            name = json.loads(metadata)["name"]
        except (ValueError, KeyError, TypeError):
            raise HandoffError("malformed agent metadata in the handoff", 400) from None
        with self._lock:
            peer_lock = self._locks.setdefault(name, threading.Lock())
        with peer_lock:
            if name not in self.agent.peers:
                try:
                    self.agent.add_peer(metadata)
                except Exception as exc:
                    raise HandoffError(f"cannot connect to the KV agent {name!r}: {exc}", 502) from None
        with self._lock:
            if len(self._names) > 1024:        # (metadata of agents long gone)
                self._names.clear()
            self._names[metadata_b64] = name
        return name

    def backend(self, peer: str) -> str | None:
        """How transfers to `peer` move ("shm", "tcp", "nixl"); None once it is gone."""
        try:
            return self.agent.peer_backend(peer)
        except PeerError:
            return None

    def metadata_b64(self) -> str:
        return base64.b64encode(self.agent.metadata()).decode()

    def read(self, peer: str, local, remote):
        return self.agent.read(peer, local, remote)

    def write(self, peer: str, local, remote, notify: bytes | None = None):
        return self.agent.write(peer, local, remote, notify=notify)

    def send_now(self, peer: str, message: bytes) -> None:
        """A notification from a thread that may wait (the writer), not through the mailbox."""
        self.agent.send_notification(peer, message)
