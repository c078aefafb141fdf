"""Shared-memory files: allocation, which tensors live in one, and stale-file clean-up.

Standard library only, outside the three layers of `common/` (see its `__init__`):
the engine core allocates its KV cache here (kv_cache.py) and kvtransfer its staged
segments (segment.py), and kvtransfer asks here whether a cache it is given lives in
a shared file (`shared_file_of`), so neither imports the other (import-linter).

A file is named `<prefix><pid>-<rest>`: the pid lets `remove_stale` unlink the files
of processes that died without cleaning up.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PAGE = 4096
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def free_bytes(shm_dir: Path = SHM_DIR) -> int:
    """Bytes an unprivileged writer can still allocate in `shm_dir`'s filesystem."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def create_shm(path: Path, size: int) -> mmap.mmap:
    """A new read-write shared mapping of `size` bytes backed by file `path` (must not exist).

    The file's pages are allocated up front (posix_fallocate): on a full tmpfs that
    fails here with OSError (ENOSPC), where a sparse file (ftruncate) would map fine
    and then kill the process with SIGBUS at the first write to a page tmpfs cannot
    back. MAP_POPULATE then faults every page in at once: far cheaper than one fault
    per 4 KiB page while the memory is first written.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def check_room(shm_dir: Path, size: int) -> None:
    """OSError(ENOSPC) unless `shm_dir` has `size` bytes free (a cheap first check that
    leaves other users their share; create_shm's posix_fallocate is the sure one)."""
    free = free_bytes(shm_dir)
    if free < size:
        raise OSError(errno.ENOSPC, f"{shm_dir} has {free} bytes free, {size} are needed")


# -- which memory lives in a shared file ----------------------------------------------


@dataclass(frozen=True)
class SharedFile:
    """A shared file mapped at `address` in this process (`size` bytes from offset 0)."""

    path: Path
    address: int
    size: int


_registry: dict[int, SharedFile] = {}  # address -> file
_registry_lock = threading.Lock()


def register(shared: SharedFile) -> None:
    """Record that `shared.size` bytes at `shared.address` are file `shared.path`."""
    with _registry_lock:
        _registry[shared.address] = shared


def unregister(address: int) -> None:
    with _registry_lock:
        _registry.pop(address, None)


def shared_file_of(address: int, nbytes: int) -> tuple[SharedFile, int] | None:
    """(the shared file, the offset in it) of the `nbytes` bytes at `address`, or None
    when they do not lie wholly in one registered file (ordinary memory, a GPU)."""
    with _registry_lock:
        for f in _registry.values():
            if f.address <= address and address + nbytes <= f.address + f.size:
                return f, address - f.address
    return None


# -- files of dead processes ----------------------------------------------------------


def remove_stale(shm_dir: Path, name: re.Pattern[str]) -> list[str]:
    """Unlink the files of `shm_dir` whose name matches `name` (group 1: the creating
    process's pid) and whose process is gone; returns their names, sorted."""
    removed = []
    try:
        names = sorted(p.name for p in shm_dir.iterdir())
    except FileNotFoundError:
        return []
    for n in names:
        m = name.match(n)
        if m is None or alive(int(m.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            (shm_dir / n).unlink()
            removed.append(n)
    return removed


# pagedserve's files in a shm dir, group 1 the pid of the process that made them: a KV
# cache (common/core/kv_cache.py) and a KV segment or in-place descriptor
# (kvtransfer/segment.py). Here, so that a sweep of a node (`remove_stale_kv_files_in`,
# run by the launcher on every Ray node) imports neither torch nor those modules.
KV_CACHE_FILE_PREFIX = "pagedserve-kvcache-"
KV_CACHE_FILE = re.compile(rf"{KV_CACHE_FILE_PREFIX}(\d{{1,10}})-[0-9a-f]{{16}}")
KV_SEGMENT_PREFIX = "pagedserve-kv-"
KV_SEGMENT_FILE = re.compile(rf"^{KV_SEGMENT_PREFIX}(\d+)-[A-Za-z0-9_.-]+(\.tmp)?$")


def remove_stale_kv_files_in(shm_dirs: list[str]) -> list[str]:
    """Unlink the KV cache files and KV segments of dead processes in each of `shm_dirs`
    (on this host); returns their paths. What a worker that was killed, or crashed,
    leaves behind: a cache file holds tmpfs memory the size of its KV cache until then."""
    removed = []
    for d in dict.fromkeys(shm_dirs):
        for name in (KV_CACHE_FILE, KV_SEGMENT_FILE):
            removed += [str(Path(d) / n) for n in remove_stale(Path(d), name)]
    return sorted(removed)


def alive(pid: int) -> bool:
    """True while process `pid` exists (another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
