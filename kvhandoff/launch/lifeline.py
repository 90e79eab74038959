"""A child of `kvhandoff up` (or of a benchmark's stack) stops when its launcher dies, however it dies.

The launcher puts its pid in the child's environment (`child_env`); the child, first thing in
`kvhandoff.cli.main`, asks the kernel for SIGTERM when its parent goes (PR_SET_PDEATHSIG) and then
checks the parent is still the one named, since it may have died before the request was made. This
replaces a subprocess preexec_fn, which is unsafe once the launcher has threads (its output readers),
as a supervisor that restarts workers always has.
"""
from __future__ import annotations

import ctypes
import os
import signal

PARENT_ENV = "KVHANDOFF_PARENT_PID"
PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str]) -> dict[str, str]:
    return {**env, PARENT_ENV: str(os.getpid())}


def hold() -> None:
    """In a child: die with the parent named in the environment (nothing to do without one)."""
    parent = os.environ.pop(PARENT_ENV, None)     # not inherited further: our own children are not its
    if not parent:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):                # it died before the kernel was asked
        os.kill(os.getpid(), signal.SIGTERM)
