"""The engine's fixed hooks (engine/kv_connector.py), routed to the protocol side that tracks each
request (EngineDoor.requests): a worker's connector knows only the sides of its role (app.py)."""
from __future__ import annotations

from kvhandoff.engine.kv_connector import KVConnector, KVEvents
from kvhandoff.worker.engine_door import EngineDoor


class Connector(KVConnector):
    def __init__(self, door: EngineDoor, loaders: list, on_layer=None):
        self.door = door
        self.loaders = loaders          # sides that post loads once per step (start_loads)
        self.on_layer = on_layer        # layer-wise push: a prefill worker's only per-layer work

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
