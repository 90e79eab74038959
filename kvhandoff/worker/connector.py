"""The engine's fixed hooks (engine/kv_connector.py), routed to the protocol side that tracks each
request (EngineDoor.requests): a worker's connector knows only the sides of its role (app.py)."""
from __future__ import annotations

from kvhandoff.engine.kv_connector import KVConnector, KVEvents
from kvhandoff.worker.engine_door import EngineDoor


class Connector(KVConnector):
    def __init__(self, door: EngineDoor, loaders: list, layers=None):
        self.door = door
        self.loaders = loaders          # sides that post loads once per step (start_loads)
        self.layers = layers            # layer-wise push (a prefill worker's): its per-layer work

    def layer_hook(self, chunks):
        return None if self.layers is None else self.layers.layer_hook(chunks)

    def reserved(self, request, num_local_tokens: int) -> None:
        side, entry = self.door.requests[request.request_id]
        side.reserved(entry, request, num_local_tokens)

    def finished(self, request, out) -> bool:
        side, entry = self.door.requests.pop(request.request_id, (None, None))
        return side is not None and side.finished(entry, request, out)

    def start_loads(self) -> None:
        for side in self.loaders:
            side.start_loads()

    def poll(self) -> KVEvents:
        return self.door.poll()

    def has_events(self) -> bool:
        return self.door.has_events()
