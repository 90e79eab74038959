"""A huge-page tmpfs for shared-memory KV pools, private to the processes that share them.

/dev/shm is usually a tmpfs without `huge=` (and /sys/kernel/mm/transparent_hugepage/shmem_enabled
is 'never' by default), so every KV pool a P/D worker shares with its peers gets 4 KiB pages, where a
colocated engine's private pool gets 2 MiB ones (kernels.streamed_memory). Copies between 4 KiB pages
ran at 0.6-0.77x a huge-page memcpy on a 2-core Zen 4 VM, and at 0.85-1.1x from a tmpfs mounted with
huge=within_size (transfer/bench.py).

Where this process may mount filesystems (root, or CAP_SYS_ADMIN), `private_huge_tmpfs` moves the
calling thread into a mount namespace of its own (unshare(CLONE_NEWNS)) in which the host's mounts
stay visible (propagation slave) but ours never leave, and mounts such a tmpfs on a fresh, empty
directory. Every process the thread starts afterwards inherits the namespace and sees the tmpfs; no
other process does, and the kernel drops the tmpfs, with whatever a killed stack left in it, when the
last process in the namespace exits, so a crash leaves at most an empty directory behind. We chose
this over mounting where the whole host sees it (a mount outlives a SIGKILLed supervisor) and over
changing the host (`mount -o remount,huge=` on /dev/shm, or reserving hugetlbfs pages): a serving
stack should not reconfigure the machine it runs on.

Only the calling thread moves (a mount namespace belongs to a thread, not a process), so call it
from the thread that starts the processes, before it starts them. A peer outside the namespace (a
worker started by hand and joined later) cannot open segments in the tmpfs: its KV agent moves those
regions over tcp instead (shm.map_grants), slower but correct.
"""
from __future__ import annotations

import ctypes
import errno
import os
import tempfile
from dataclasses import dataclass

from kvhandoff.transfer.memory import SHM_DIR, tmpfs_huge

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_SLAVE = 0x2, 0x4, 0x8, 0x4000, 0x80000
MNT_DETACH = 0x2


@dataclass
class ShmDir:
    """Where shared-memory regions go: `path`, and in words why it is that one."""
    path: str
    huge: bool
    why: str
    mounted: bool = False       # ours: unmount it when done

    def close(self) -> None:
        """Unmount our tmpfs (lazily: processes may still map it) and remove its mount point."""
        if not self.mounted:
            return
        self.mounted = False
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(self.path.encode(), MNT_DETACH)
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def private_huge_tmpfs(base: str = SHM_DIR, flag: str = "--kv-shm-dir") -> ShmDir:
    """A directory whose files get huge pages: `base` if it already gives them, else a private
    huge=within_size tmpfs of the same size where this process may mount one, else `base` with the
    reason it is not huge (and what to do about it with `flag`)."""
    if tmpfs_huge(base):
        return ShmDir(base, True, f"{base} already gives huge pages")
    try:
        path = _mount_private(base)
    except OSError as e:
        why = ("this process may not mount a filesystem (run as root, or with CAP_SYS_ADMIN)"
               if e.errno in (errno.EPERM, errno.EACCES) else f"mounting a tmpfs failed: {e}")
        return ShmDir(base, False, f"4 KiB pages in {base}: {why}; or mount a tmpfs with huge=within_size "
                                   f"and pass {flag}")
    mounted = ShmDir(path, True, f"a huge-page tmpfs at {path}, seen only by the processes this one starts",
                     mounted=True)
    if not tmpfs_huge(path):        # e.g. shmem_enabled 'deny', or a kernel without THP for tmpfs
        mounted.close()
        return ShmDir(base, False, f"4 KiB pages in {base}: a tmpfs mounted with huge=within_size gives none here")
    return mounted


def _mount_private(base: str) -> str:
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")

    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # Slave: the host's later mounts still reach us; ours never reach the host.
    check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "making / a slave mount")
    options = "huge=within_size,mode=0700"
    try:
        st = os.statvfs(base)
        options += f",size={st.f_blocks * st.f_frsize}"     # the same room as /dev/shm; else tmpfs's half of RAM
    except OSError:
        pass
    path = tempfile.mkdtemp(prefix="kvhandoff-shm-")
    try:
        check(libc.mount(b"kvhandoff-shm", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                         options.encode()), f"mounting a tmpfs at {path}")
    except OSError:
        os.rmdir(path)
        raise
    return path
