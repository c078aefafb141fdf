"""Run import-linter (the `[tool.importlinter]` contracts of pyproject.toml) on this tree.

Why a script: the package is installed with setuptools' `package-dir` mapping
(`pagedserve.common` -> `common/`, ...), which an editable install resolves through a
meta-path finder that grimp (import-linter's graph builder) does not consult; from a
source tree grimp would find no `pagedserve.common` at all. So this builds what an
installed wheel looks like, as symlinks, under build/lint/ (`pagedserve/` with its own
entries plus `common -> ../../../common`, `router`, ...), puts it first on PYTHONPATH
and runs `lint-imports` there. grimp follows the symlinks; nothing is copied.

Usage: python scripts/lint_imports.py [lint-imports options]; exit status is lint-imports'.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
FARM = ROOT / "build" / "lint"


def package_dirs() -> dict[str, Path]:
    """`pagedserve.<sub>` -> its source folder, from pyproject's package-dir."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {
        name.removeprefix("pagedserve."): ROOT / folder
        for name, folder in mapping.items()
        if name.startswith("pagedserve.")
    }


def build_farm() -> Path:
    """build/lint/pagedserve: symlinks to every entry of pagedserve/ and each mapped folder."""
    pkg = FARM / "pagedserve"
    shutil.rmtree(FARM, ignore_errors=True)
    pkg.mkdir(parents=True)
    mapped = package_dirs()
    for entry in (ROOT / "pagedserve").iterdir():
        if entry.name not in mapped and entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry.resolve())
    for name, folder in mapped.items():
        (pkg / name).symlink_to(folder.resolve())
    return FARM


def main(argv: list[str]) -> int:
    farm = build_farm()
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(farm), os.environ.get("PYTHONPATH", "")])
    )
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe) if exe.exists() else "lint-imports", str(ROOT / "pyproject.toml")]
    return subprocess.call([*cmd, *argv], cwd=farm, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
