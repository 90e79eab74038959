"""The build cache: folders built once per key under $KVHANDOFF_CACHE (else ~/.cache/kvhandoff).

Workers start at the same moment, so a folder is built under a file lock and published by an atomic
rename: a reader never sees half of one. Converted models (loader.py) and compiled kernels
(kernels.py) live here.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("KVHANDOFF_CACHE") or Path.home() / ".cache" / "kvhandoff").expanduser()


def cached_build(key: str, build: Callable[[Path], object]) -> Path:
    """cache_root()/key, running build(tmp_dir) first if it is not there yet. Safe across processes."""
    root = cache_root()
    final = root / key
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{key}.lock"):
        if final.is_dir():          # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
        try:
            tmp.chmod(0o755)        # mkdtemp makes it private; the cache is as readable as its root
            build(tmp)
            os.rename(tmp, final)   # atomic: readers see nothing or the whole folder
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


@contextmanager
def _file_lock(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
