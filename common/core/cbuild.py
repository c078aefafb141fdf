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
import logging
import os
import platform
import re
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


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def local_includes(source: Path) -> list[Path]:
    """The files `source` includes with `#include "..."` (relative to its folder, as
    gcc finds them), so that a change in a shared header rebuilds every library
    that uses it. One level deep: the package's headers include only system ones."""
    return [source.parent / name for name in _LOCAL_INCLUDE.findall(source.read_text())]


def load_or_none(
    source: Path,
    flags: Sequence[str],
    env_switch: str,
    what: str,
    fallback: str,
    log: logging.Logger,
) -> ctypes.CDLL | None:
    """`build_and_load`, or None when `env_switch`=0 (logged at INFO) or anything fails
    (logged at WARNING on the caller's `log`, naming `what` is lost and the `fallback`
    used instead: the fallback is slower, so a machine without gcc must not lose the
    library silently)."""
    if os.environ.get(env_switch, "1") == "0":
        log.info("%s disabled by %s=0", what, env_switch)
        return None
    try:
        return build_and_load(source, flags)
    except Exception as e:  # any failure means: use the fallback
        log.warning(
            "%s unavailable (%s): using %s, which is slower; install a C compiler "
            "(Debian/Ubuntu: apt-get install gcc) to build it, or set %s=0 to choose "
            "that quietly",
            what,
            e,
            fallback,
            env_switch,
        )
        return None


def build_and_load(source: Path, flags: Sequence[str]) -> ctypes.CDLL:
    """The library built from `source` with `flags` (from the cache when built
    before), loaded. Raises RuntimeError when there is no compiler or the build
    fails, OSError when the library does not load."""
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        raise RuntimeError("no C compiler (gcc, or $CC) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    texts = [source.read_text(), *(h.read_text() for h in local_includes(source))]
    key = hashlib.sha256(
        "\0".join((*texts, " ".join(flags), version.stdout, cpu_signature())).encode()
    ).hexdigest()[:20]
    path = cache_dir() / f"{source.stem}-{key}.so"
    if not path.exists():
        compile_library(cc, source, flags, path)
    return ctypes.CDLL(str(path))
