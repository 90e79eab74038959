"""Memory populated ahead of its first use, in the background: a colocated engine's KV pool (private,
model/kernels.py) and every shared-memory segment (transfer/memory.py). Torch-free, so the transfer
layer takes it in without torch."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading

import numpy as np

MADV_POPULATE_WRITE = 23        # Linux 5.14+: fault every page in, writable, without touching its bytes
# madvise holds the process's mmap lock for as long as it populates, and every thread that maps memory
# meanwhile (Python's allocator growing, a module imported) waits on it: one call over a tiny worker's
# 512 MiB pool held its start-up 0.8-1.7 s on a 2-core AVX2 EPYC (build_worker 0.07-0.08 s in chunks).
POPULATE_CHUNK = 8 << 20
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
log = logging.getLogger("kvhandoff.pages")


def populate_in_background(array: np.ndarray, read_fallback: bool) -> threading.Thread:
    """Fault every page of `array` in now, on a thread of its own (madvise through ctypes, so without
    the GIL, and in chunks, so without the mmap lock for long: 0.2-0.9 s for a 512 MiB pool, which
    must not stall anyone), leaving its bytes alone: the owner may write it meanwhile, and `array`
    keeps the mapping alive; the thread is returned for whoever must wait. On a kernel that refuses the
    advice (before 5.14): with `read_fallback`, by reading a byte of every page, which numpy does
    without the GIL (a read fault maps a page of a shared writable mapping writable); without it,
    pages fault in on first use (a private page read maps only the zero page)."""
    def populate() -> None:
        start, nbytes = array.ctypes.data, array.nbytes
        if all(_libc.madvise(start + offset, min(POPULATE_CHUNK, nbytes - offset), MADV_POPULATE_WRITE) == 0
               for offset in range(0, nbytes, POPULATE_CHUNK)):
            return
        log.debug("madvise(MADV_POPULATE_WRITE): %s; %s", os.strerror(ctypes.get_errno()),
                  "reading every page instead" if read_fallback else "pages fault in on first use")
        if read_fallback:
            array[::mmap.PAGESIZE].max()
    thread = threading.Thread(target=populate, name="kvh-populate", daemon=True)
    thread.start()
    return thread
