"""Which tests depend on the CPU flags that dtype "auto" resolves by, and the check that
no test does so by accident.

The flags are read in exactly one place, `pagedserve.common.core.config.cpu_flags`
(`$PAGEDSERVE_CPU_FLAGS` when set, else /proc/cpuinfo); `resolve_dtype("auto", "cpu")`
is the engine's only way there. This plugin wraps that function for the whole session
and counts its calls while each test is set up and run (module fixtures included, so an
engine built by a fixture counts for the first test that uses it; engines built on
other threads of this process count too).

- A test that read the flags must carry `@pytest.mark.dtype_auto`, else it fails:
  it left its dtype to `auto` (bf16 on CPUs with bf16 units, fp32 elsewhere), which
  is almost always a forgotten `dtype=`, on every machine (not only on the other
  kind of CPU).
- `make test-dtypes` runs the marked tests (`-m dtype_auto`) once as on a CPU with
  bf16 units and once as on one without, whatever this CPU is. That replaces running
  five whole files twice more (250 tests, ~4 min on a 2-core Skylake-SP Xeon) when
  only the tests that read the flags could see a difference; and it now covers every
  file, not five.

What it cannot see: flags read in another process (a launcher or Ray worker started by
a test). Those tests state their dtype on the command line (`--dtype float32`).
tests/test_dtype_guard.py proves the check: an unmarked test resolving `auto` fails,
marked it passes and is what `-m dtype_auto` selects.
"""

from __future__ import annotations

import pytest

from pagedserve.common.core import config

MARKER = "dtype_auto"

_reads = 0
_real_cpu_flags = config.cpu_flags


def _counting_cpu_flags() -> frozenset[str]:
    global _reads
    _reads += 1
    return _real_cpu_flags()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: reads the CPU flags (resolves dtype auto); run by `make test-dtypes` "
        "under each PAGEDSERVE_CPU_FLAGS setting (tests/dtype_guard.py)",
    )
    _patch()


def _patch() -> None:
    # Set on the module, as config's own functions look it up there at each call. This
    # runs before pytest imports any test module, so a test module that imports the name
    # itself (tests/test_dtype.py) gets the counting one too.
    config.cpu_flags = _counting_cpu_flags


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    global _reads
    _reads = 0
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    if _reads and item.get_closest_marker(MARKER) is None:
        raise AssertionError(
            f"{item.nodeid} resolved dtype 'auto' (read the CPU flags {_reads} time(s), "
            "in the test or a fixture it set up): its outcome then depends on the CPU. "
            "State the dtype (dtype='float32' for parity with an fp32 reference), or, "
            f"if `auto` is the point, mark it @pytest.mark.{MARKER} so that "
            "`make test-dtypes` runs it as on both kinds of CPU (tests/dtype_guard.py)."
        )
    return result
