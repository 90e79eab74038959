"""The processes and threads a launched child became, read from /proc: its descendants, their threads,
and what CPU each has used. The launcher places a vLLM server's threads with them (vllm.py); the
benchmarks account a stack's CPU (bench/stack.py)."""
from __future__ import annotations

import os
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it, children of any of its threads included (vLLM's API server
    starts an engine core, which starts a worker)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in tasks([current]):
            try:
                todo += [int(c) for c in Path(task, "children").read_text().split()]
            except OSError:
                pass
    return found


def tasks(pids: list[int]) -> list[str]:
    """Every thread of these processes, as its /proc/PID/task/TID path."""
    found = []
    for pid in pids:
        try:
            found += [f"/proc/{pid}/task/{t}" for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
    return found


def cpu_ticks(path: str) -> int:
    """User + system clock ticks of /proc/PID (the whole process) or /proc/PID/task/TID (that thread
    alone: /proc/TID would give its whole process's); 0 for one that is gone."""
    try:
        fields = Path(path, "stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return 0
