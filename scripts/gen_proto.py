#!/usr/bin/env python3
"""Generate the gRPC/protobuf stubs of proto/pagedserve/v1/*.proto.

Runs, from the repository root, exactly

    python -m grpc_tools.protoc -Iproto --python_out=OUT --grpc_python_out=OUT \
        --mypy_out=OUT proto/pagedserve/v1/*.proto

with OUT = the repository root by default, so the stubs land in pagedserve/v1/ (the
`pagedserve` package) and their `from pagedserve.v1 import x_pb2` imports resolve.

The stubs are build outputs, git-ignored, never edited by hand. Decisions:
- Idempotent: nothing is regenerated when every expected output exists and is newer
  than every .proto (and than this script). Since .proto files import each other, one
  change regenerates them all. `--force` regenerates regardless.
- Stubs whose .proto is gone are deleted, so a renamed file leaves no stale module.
- `--out DIR` generates elsewhere (tests compare that against the in-tree stubs);
  `--check` generates into a temporary directory and exits 1 when the in-tree stubs
  differ from it (stale or hand-edited), without touching them.
- The mypy plugin is looked up next to this Python interpreter first, so the script
  works from a virtual environment that is not on PATH.

Exit status: 0 on success, 1 when protoc fails or --check finds a difference, 2 on a
usage error (no .proto files, missing tools).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = Path("pagedserve") / "v1"  # relative to PROTO_ROOT and to the output dir
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class GenError(Exception):
    """Generation failed; the message says why, `exit_code` is what main returns."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto files of pagedserve.v1, sorted (stable protoc argument order)."""
    return sorted((proto_root / PACKAGE).glob("*.proto"))


def expected_outputs(protos: list[Path], out: Path) -> list[Path]:
    """The stub files protoc writes for `protos` under `out`."""
    return [out / PACKAGE / f"{p.stem}{suffix}" for p in protos for suffix in SUFFIXES]


def is_stale(protos: list[Path], out: Path) -> bool:
    """True when an output is missing or older than a .proto or this script."""
    outputs = expected_outputs(protos, out)
    if not all(o.exists() for o in outputs):
        return True
    newest_input = max(p.stat().st_mtime for p in [*protos, Path(__file__)])
    oldest_output = min(o.stat().st_mtime for o in outputs)
    return oldest_output < newest_input


def _mypy_plugin() -> str:
    """Path of protoc-gen-mypy: next to the interpreter, else on PATH."""
    local = Path(sys.executable).parent / "protoc-gen-mypy"
    found = str(local) if local.exists() else shutil.which("protoc-gen-mypy")
    if not found:
        raise GenError("protoc-gen-mypy not found: pip install mypy-protobuf", 2)
    return found


def run_protoc(protos: list[Path], out: Path) -> None:
    """Invoke grpc_tools.protoc on `protos`, writing stubs under `out`."""
    try:
        import grpc_tools  # noqa: F401
    except ImportError as e:
        raise GenError("grpc_tools not importable: pip install grpcio-tools", 2) from e
    (out / PACKAGE).mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--plugin=protoc-gen-mypy={_mypy_plugin()}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        *[str(p) for p in protos],
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise GenError(f"protoc failed ({result.returncode}):\n{result.stderr.strip()}")
    missing = [str(o) for o in expected_outputs(protos, out) if not o.exists()]
    if missing:
        raise GenError(f"protoc succeeded but did not write {missing}")


def remove_orphans(protos: list[Path], out: Path) -> list[Path]:
    """Delete stubs in out/pagedserve/v1 whose .proto no longer exists."""
    keep = set(expected_outputs(protos, out))
    orphans = [
        f
        for suffix in SUFFIXES
        for f in (out / PACKAGE).glob(f"*{suffix}")
        if f not in keep and f.name.endswith(suffix)
    ]
    for f in orphans:
        f.unlink()
    return orphans


def generate(out: Path = ROOT, force: bool = False) -> bool:
    """Generate the stubs under `out` if stale (or `force`); True if it regenerated."""
    protos = proto_files()
    if not protos:
        raise GenError(f"no .proto files in {PROTO_ROOT / PACKAGE}", 2)
    remove_orphans(protos, out)
    if not force and not is_stale(protos, out):
        return False
    run_protoc(protos, out)
    return True


def differences(out: Path = ROOT) -> list[str]:
    """Stub files under `out` that differ from a fresh generation (names relative to it)."""
    protos = proto_files()
    with tempfile.TemporaryDirectory() as tmp:
        run_protoc(protos, Path(tmp))
        diff = []
        for fresh in expected_outputs(protos, Path(tmp)):
            rel = fresh.relative_to(tmp)
            current = out / rel
            if not current.exists() or not filecmp.cmp(fresh, current, shallow=False):
                diff.append(str(rel))
        return diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="regenerate even if up to date")
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo)")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the stubs under --out are stale"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            diff = differences(args.out)
            if diff:
                print(f"stale stubs (run scripts/gen_proto.py): {diff}", file=sys.stderr)
                return 1
            print("stubs up to date")
            return 0
        regenerated = generate(args.out, force=args.force)
    except GenError as e:
        print(f"gen_proto: {e}", file=sys.stderr)
        return e.exit_code
    rel = os.path.relpath(args.out / PACKAGE, ROOT)
    print(f"generated stubs in {rel}" if regenerated else f"stubs in {rel} up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
