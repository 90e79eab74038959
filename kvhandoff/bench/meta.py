"""What every benchmark records about itself: where it ran, on what code, and its progress lines."""
from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fmt(value, spec: str = ".1f") -> str:
    """A number for a table, '-' for a missing one."""
    return "-" if value is None else format(value, spec)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def git_commit() -> str:
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = (line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
            return next(names, platform.processor())
    except OSError:
        return platform.processor()


