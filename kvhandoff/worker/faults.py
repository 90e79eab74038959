"""Fault injection for tests (issue 7): make this worker's transfers fail, slow or vanish, or kill it.

Enabled only by `kvhandoff serve --inject-faults SPEC`, never by default. SPEC is comma-separated:
- `read_fail` / `write_fail`: every KV READ (WRITE) this worker posts fails.
- `slow_ms=N`: every READ or WRITE this worker posts leaves N ms late, each on its own (a link's
  latency): transfers queued together are late together, not one after another.
- `step_ms=N`: every engine step of this worker takes N ms longer (a slow or overloaded worker).
- `verify_ms=N`: decode side: checking a handoff's arrived KV takes N ms longer (a big prompt's
  checksums on a busy core), which widens the window in which the request can end meanwhile.
- `engine_fail`: the engine loop raises at its first step, as a bug in the engine would: the worker
  fails what it had and stops itself with status 1 (so that a supervisor starts a fresh one).
- `drop=KIND[+KIND]`: notifications of these kinds are not sent (done, failed, release, renew, cancel,
  unlease); `delay_ms=N`: every notification is sent N ms late.
- `drop_events=N`: every Nth KV-event batch this worker publishes is not sent (it stays in the replay
  buffer): a batch lost on the way, which a router must find by its sequence number and replay.
- `kill_at=PHASE`: the worker SIGKILLs itself (a crash: no cleanup, no goodbye) the first time one of
  its handoffs reaches PHASE:
  `registered`: prefill, push: a registration arrived; prefill, pull: the prompt's KV is pinned for a
  reader. Decode, push: its registration was sent; decode, pull: blocks reserved, READ not posted.
  `transfer`: the side that moves the bytes has posted its first WRITE (prefill, push) or READ
  (decode, pull) and not seen it finish.
  `decode`: decode side, a request has streamed KILL_AFTER_TOKENS tokens (the kill follows KILL_DELAY_S
  later, so those tokens have left the worker).
Each injected fault is logged as such.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

KINDS = ("done", "failed", "release", "renew", "progress", "cancel", "unlease")
KILL_PHASES = ("registered", "transfer", "decode")
KILL_AFTER_TOKENS = 4
KILL_DELAY_S = 0.2


@dataclass
class Faults:
    read_fail: bool = False
    write_fail: bool = False
    slow_ms: float = 0.0
    step_ms: float = 0.0
    verify_ms: float = 0.0
    drop: set[str] = field(default_factory=set)
    delay_ms: float = 0.0
    kill_at: str | None = None
    engine_fail: bool = False
    drop_events: int = 0

    @classmethod
    def parse(cls, spec: str | None) -> "Faults":
        faults = cls()
        for part in (spec or "").split(","):
            key, _, value = part.strip().partition("=")
            if not key:
                continue
            if key in ("read_fail", "write_fail", "engine_fail") and not value:
                setattr(faults, key, True)
            elif key == "drop" and value:
                kinds = set(value.split("+"))
                if not kinds <= set(KINDS):
                    raise ValueError(f"drop= takes {'+'.join(KINDS)}, not {value!r}")
                faults.drop |= kinds
            elif key in ("delay_ms", "slow_ms", "step_ms", "verify_ms") and value:
                setattr(faults, key, float(value))
            elif key == "drop_events" and value.isdigit() and int(value) > 0:
                faults.drop_events = int(value)
            elif key == "kill_at" and value in KILL_PHASES:
                faults.kill_at = value
            else:
                raise ValueError(f"unknown fault {part.strip()!r}; see kvhandoff/worker/faults.py")
        return faults

    @property
    def any(self) -> bool:
        return (self.read_fail or self.write_fail or bool(self.drop) or self.delay_ms > 0 or self.slow_ms > 0
                or self.step_ms > 0 or self.verify_ms > 0 or self.kill_at is not None or self.engine_fail
                or self.drop_events > 0)

    def reached(self, phase: str, handoff_id: str, delay_s: float = 0.0) -> None:
        """A handoff of this worker reached `phase`: die here if told to."""
        assert phase in KILL_PHASES
        if self.kill_at != phase:
            return
        self.kill_at = None             # once: a delayed kill must not be scheduled again meanwhile
        log.warning("fault injection: killing this worker at %s (handoff %s)", phase, handoff_id)
        for handler in logging.getLogger().handlers:
            handler.flush()
        if delay_s > 0:
            threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    def due(self) -> float:
        """When a transfer queued now may leave: now, or slow_ms later."""
        return time.monotonic() + self.slow_ms / 1000


def wait_until(due: float) -> None:
    """Hold a queued transfer back until it is due. Queues are FIFO and every item is late by the
    same amount, so waiting for the head never delays a later item past its own due time."""
    delay = due - time.monotonic()
    if delay > 0:
        time.sleep(delay)
