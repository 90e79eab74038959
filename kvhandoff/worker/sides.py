"""The protocol sides one worker runs, by role (app.py builds only its role's)."""
from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.wire.modes import Mode
from kvhandoff.worker.layerwise import LayerwisePrefill
from kvhandoff.worker.pull import PullDecode, PullPrefill
from kvhandoff.worker.push import PushDecode
from kvhandoff.worker.reuse import Retention, ReusePrefill


@dataclass
class PrefillSides:
    """A prefill worker's protocol sides."""
    pull: PullPrefill
    push: LayerwisePrefill          # push and push-layerwise
    reuse: ReusePrefill | None      # --bidirectional: reads retained history back

    def of(self, mode: Mode):
        return self.pull if mode.is_pull else self.push


@dataclass
class DecodeSides:
    """A decode worker's protocol sides."""
    pull: PullDecode
    push: PushDecode
    retention: Retention | None     # --bidirectional: keeps finished turns' KV

    def of(self, mode: Mode):
        return self.pull if mode.is_pull else self.push
