"""Build a C source of this package into a shared library once, cache it, load it.

Shared by the CPU attention kernel (`attention/cpu_kernel.py`) and the fused
bf16 ops (`cpu_ops.py`). The library is built with the given gcc flags once per
source text, flags, compiler version and CPU (the flags usually say
`-march=native`), into `$PAGEDSERVE_CACHE_DIR` (default `~/.cache/pagedserve`)
/kernels/, written to a temporary name and renamed so that processes building at
once never load a half-written file. Failures raise; the callers decide how to
fall back and what to log.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pagedserve.common.core.config import cpuinfo_flags


def cache_dir() -> Path:
    """Where built kernels live: $PAGEDSERVE_CACHE_DIR or ~/.cache/pagedserve, /kernels."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return (base if root else base / "pagedserve") / "kernels"


def cpu_signature() -> str:
    """The CPU's feature flags (the builds use -march=native)."""
    flags = cpuinfo_flags()
    return " ".join(sorted(flags)) if flags else platform.processor() or platform.machine()


def compile_library(cc: str, source: Path, flags: Sequence[str], out: Path) -> None:
    """`cc flags -o out source`, atomically (a temporary file renamed into place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-o", tmp, str(source)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_and_load(source: Path, flags: Sequence[str]) -> ctypes.CDLL:
    """The library built from `source` with `flags` (from the cache when built
    before), loaded. Raises RuntimeError when there is no compiler or the build
    fails, OSError when the library does not load."""
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        raise RuntimeError("no C compiler (gcc, or $CC) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    key = hashlib.sha256(
        "\0".join((source.read_text(), " ".join(flags), version.stdout, cpu_signature())).encode()
    ).hexdigest()[:20]
    path = cache_dir() / f"{source.stem}-{key}.so"
    if not path.exists():
        compile_library(cc, source, flags, path)
    return ctypes.CDLL(str(path))
