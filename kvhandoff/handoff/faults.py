"""Fault injection for tests (issue 7): make this worker's transfers fail or its notifications vanish.

Enabled only by `kvhandoff serve --inject-faults SPEC`, never by default. SPEC is comma-separated:
`read_fail` (every KV READ this worker posts fails), `write_fail` (every KV WRITE), `drop=KIND[+KIND]`
(notifications of these kinds are not sent: done, failed, release, renew, cancel, unlease),
`delay_ms=N` (every notification is sent N ms late). Each injected fault is logged as such.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("done", "failed", "release", "renew", "cancel", "unlease")


@dataclass
class Faults:
    read_fail: bool = False
    write_fail: bool = False
    drop: set[str] = field(default_factory=set)
    delay_ms: float = 0.0

    @classmethod
    def parse(cls, spec: str | None) -> "Faults":
        faults = cls()
        for part in (spec or "").split(","):
            key, _, value = part.strip().partition("=")
            if not key:
                continue
            if key in ("read_fail", "write_fail") and not value:
                setattr(faults, key, True)
            elif key == "drop" and value:
                kinds = set(value.split("+"))
                if not kinds <= set(KINDS):
                    raise ValueError(f"drop= takes {'+'.join(KINDS)}, not {value!r}")
                faults.drop |= kinds
            elif key == "delay_ms" and value:
                faults.delay_ms = float(value)
            else:
                raise ValueError(f"unknown fault {part.strip()!r}; see kvhandoff/handoff/faults.py")
        return faults

    @property
    def any(self) -> bool:
        return self.read_fail or self.write_fail or bool(self.drop) or self.delay_ms > 0
