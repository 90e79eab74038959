"""Registered memory: a tensor, array or buffer seen as one flat byte array, and shared-memory
segments in /dev/shm that a peer on the same host can map.

Segments are files in /dev/shm (or `shm_dir`) created with mode 0600 (only our user can map them) and
fully reserved up front, so a full /dev/shm fails at allocation instead of as SIGBUS on first touch.
Their names carry the creator's pid namespace, pid and process start time: an owner that exits
normally unlinks them, and after a crash anyone who finds a segment whose creator is gone (every
agent at start, and a peer that saw its owner die) removes it. We chose this over unlink-once-mapped
because peers map segments long after they are created (whenever they connect), so the name must
live as long as the owner does.

Huge pages matter: /dev/shm is usually a tmpfs with huge=never, so segments get 4 KiB pages, and on a
VM copying 256 KiB blocks between such pages measured at about half the speed of huge-page memory
(7 vs 13.5 GB/s; same copy, same machine). Point `shm_dir` at a tmpfs mounted with huge=within_size,
or remount /dev/shm with huge=advise (we madvise every mapping), and the shm backend runs at memcpy
speed.

Every mapping is populated in the background as soon as it exists (model/pages.py): a page of a tmpfs
mapping costs ~1.7 us of the toucher's time on its first access (a minor fault), ~0.45 ms per MiB,
which the prefill's compute (writing its KV into the pool), a copy and the decode's landing would
otherwise pay on the request's critical path until the whole pool had been used once, where a
colocated engine's pool (torch.zeros) was touched when it was made.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from dataclasses import dataclass

import numpy as np

from kvhandoff.model.pages import populate_in_background

SHM_DIR = "/dev/shm"
PREFIX = "kvh."
_SAFE = re.compile(r"[^A-Za-z0-9_-]")
SEGMENT_NAME = re.compile(r"^kvh\.(\d+)\.(\d+)\.(\d+)\.[A-Za-z0-9_.-]+$")   # pidns, pid, start time, tag


def byte_view(obj) -> np.ndarray:
    """A flat, writable uint8 numpy array sharing memory with `obj` (CPU torch tensor, numpy array,
    or any writable contiguous buffer such as bytearray or mmap)."""
    if type(obj).__module__.startswith("torch"):
        if obj.device.type != "cpu":
            raise TypeError(f"only CPU tensors can be registered for now, got a {obj.device} tensor")
        if not obj.is_contiguous():
            raise TypeError("a registered tensor must be contiguous")
        import torch
        arr = obj.detach().reshape(-1).view(torch.uint8).numpy()
    elif isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise TypeError("a registered array must be C-contiguous")
        arr = obj.reshape(-1).view(np.uint8)
    else:
        arr = np.frombuffer(memoryview(obj).cast("B"), dtype=np.uint8)
    if not arr.flags.writeable:
        raise TypeError(f"a registered buffer must be writable ({type(obj).__name__} is read-only)")
    if arr.size == 0:
        raise ValueError("cannot register an empty buffer")
    return arr


def process_start_time(pid: int) -> int | None:
    """Start time of a live process (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()   # the command name may itself contain ") "
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def _pid_namespace() -> int:
    # pids mean nothing across pid namespaces: only segments of our own namespace are ever swept.
    return os.stat("/proc/self/ns/pid").st_ino


@dataclass(eq=False)
class Segment:
    """A mapped shared-memory file: ours (we created it and unlink it) or a peer's (mapped to copy into)."""
    directory: str
    name: str
    nbytes: int
    array: np.ndarray | None        # uint8 view of the whole mapping; None once released
    dev_ino: tuple[int, int]        # identity of the file, so a peer can check it opened the same one
    owned: bool

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    def contains(self, arr: np.ndarray) -> int | None:
        """Offset of `arr`'s memory inside this segment, or None if it is not entirely inside."""
        if self.array is None:
            return None
        offset = arr.ctypes.data - self.array.ctypes.data
        return offset if 0 <= offset and offset + arr.nbytes <= self.nbytes else None

    def unlink(self) -> None:
        if self.owned:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def release(self) -> None:
        # Only drop our reference: copies in flight or the user's tensors may still view the mapping,
        # and the kernel unmaps it when the last of them is gone (closing it now could crash them).
        self.array = None


class NoRoom(OSError):
    """The shared-memory directory cannot hold a segment; the message says what to change."""


def no_room(directory: str, nbytes: int) -> NoRoom:
    st = os.statvfs(directory)
    mib = lambda n: f"{n / 2**20:,.0f} MiB"
    return NoRoom(errno.ENOSPC, f"the KV pool needs {mib(nbytes)} of shared memory in {directory}, which has "
                  f"{mib(st.f_bavail * st.f_frsize)} free of {mib(st.f_blocks * st.f_frsize)}: lower --kv-cache-mb "
                  f"(or --num-blocks), give {directory} more room (docker run --shm-size=2g; mount -o remount,"
                  f"size=2G {directory}), or point --kv-shm-dir at a larger tmpfs")


def create_segment(tag: str, nbytes: int, directory: str = SHM_DIR) -> Segment:
    """A new zero-filled segment of `nbytes`, mode 0600, named after this process and `tag`."""
    assert nbytes > 0
    me = os.getpid()
    safe_tag = _SAFE.sub("_", tag)[:64]
    name = f"{PREFIX}{_pid_namespace()}.{me}.{process_start_time(me)}.{safe_tag}.{secrets.token_hex(4)}"
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)                      # whatever the umask, never more than the owner
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise no_room(directory, nbytes) from None
        mapping = _map(fd, nbytes)
        st = os.fstat(fd)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    array = np.frombuffer(mapping, dtype=np.uint8)
    populate_in_background(array, read_fallback=True)
    return Segment(directory, name, nbytes, array, (st.st_dev, st.st_ino), owned=True)


def open_segment(directory: str, name: str, dev_ino: tuple[int, int], min_bytes: int) -> Segment:
    """Map a peer's segment; raises OSError unless it is the very file the peer described."""
    if not SEGMENT_NAME.match(name) or not os.path.isabs(directory):
        raise OSError(f"refusing to open {directory!r}/{name!r}: not a kvhandoff segment")
    fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != tuple(dev_ino):
            raise OSError(f"{name} is not the peer's segment (another /dev/shm: not the same host)")
        if st.st_size < min_bytes:
            raise OSError(f"{name} has {st.st_size} bytes, the peer granted {min_bytes}")
        mapping = _map(fd, st.st_size)
    finally:
        os.close(fd)
    array = np.frombuffer(mapping, dtype=np.uint8)
    populate_in_background(array, read_fallback=True)
    return Segment(directory, name, st.st_size, array, tuple(dev_ino), owned=False)


def tmpfs_huge(directory: str) -> bool | None:
    """Whether files in `directory` get huge pages (from its mount's huge= option and the global
    shmem_enabled); None when it is not a tmpfs."""
    try:
        dev = os.stat(directory).st_dev
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            shmem = re.search(r"\[(\w+)\]", f.read())[1]
    except (OSError, TypeError):
        return None
    mine = [line.split(" - ", 1)[1].split() for line in lines
            if line.split()[2] == f"{os.major(dev)}:{os.minor(dev)}" and " - " in line]
    if not mine or mine[-1][0] != "tmpfs":
        return None
    if shmem in ("deny", "force"):
        return shmem == "force"
    opts = mine[-1][2].split(",") if len(mine[-1]) > 2 else []
    return any(o in ("huge=always", "huge=within_size", "huge=advise") for o in opts)


def huge_page_share(array: np.ndarray) -> float | None:
    """The share of `array`'s mapping (resident part) that huge pages map, from /proc/self/smaps."""
    addr, inside, rss, huge = array.ctypes.data, False, 0, 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                field = line.split(None, 2)
                if not field[0].endswith(":"):
                    lo, hi = (int(x, 16) for x in field[0].split("-"))
                    inside = lo <= addr < hi
                elif inside and field[0] == "Rss:":
                    rss = int(field[1])
                elif inside and field[0] in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                    huge += int(field[1])
    except OSError:
        return None
    return huge / rss if rss else None


def _map(fd: int, nbytes: int) -> mmap.mmap:
    mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)     # taken up where the tmpfs allows it (huge=advise); else a no-op
    except (AttributeError, OSError):
        pass
    return mapping


def sweep_stale_segments(pid: int | None = None, directory: str = SHM_DIR) -> list[str]:
    """Unlink our user's segments (in our pid namespace) whose creator is gone; only `pid`'s if given."""
    removed, pidns, uid = [], _pid_namespace(), os.geteuid()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = SEGMENT_NAME.match(name)
        if not m or int(m[1]) != pidns or (pid is not None and int(m[2]) != pid):
            continue
        if str(process_start_time(int(m[2]))) == m[3]:
            continue                                  # the creator is alive (same pid, same start)
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid == uid:
                os.unlink(path)
                removed.append(name)
        except FileNotFoundError:
            pass
    return removed


@dataclass(eq=False)
class Region:
    """A registered region: what peers may touch, by name (ours) or id (on the wire)."""
    name: str
    id: int                     # never reused, so a request for a deregistered region cannot hit its successor
    array: np.ndarray           # flat uint8 view
    owner: object               # the registered object, kept alive while registered
    segment: Segment | None     # set when the memory lies in one of our shm segments
    segment_offset: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def addr(self) -> int:
        return int(self.array.ctypes.data)

    def grant(self) -> dict:
        """What a peer learns about this region (over the authenticated connection only)."""
        g = {"id": self.id, "nbytes": self.nbytes, "addr": self.addr, "shm": None}
        if self.segment is not None:
            g.update(shm=self.segment.name, shm_dir=self.segment.directory, shm_offset=self.segment_offset,
                     shm_dev_ino=list(self.segment.dev_ino))
        return g
