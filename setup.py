"""Build step: the gRPC/protobuf stubs are generated into the wheel, never committed.

Everything else is declared in pyproject.toml. A wheel (or `pip install .`) runs
`build_py`, which here also runs scripts/gen_proto.py into the build directory, so an
installed package has `pagedserve.v1.*_pb2*` without the source tree. An editable
install (`pip install -e .`, what `make` does) maps the source tree instead, whose
stubs `make proto` writes (git-ignored); so editable builds skip the step.
"""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        sys.path.insert(0, str(ROOT / "scripts"))
        try:
            import gen_proto
        finally:
            sys.path.pop(0)
        gen_proto.generate(out=Path(self.build_lib), force=True)


setup(cmdclass={"build_py": BuildPyWithStubs})
