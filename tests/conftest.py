"""Session-wide test setup.

TRITON_INTERPRET must be set before anything imports triton, so it is set here,
at the top of the first module pytest loads. No test needs a GPU: Triton kernels
run in the interpreter on CPU tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models on 2 shared cores: one thread each is ~10x faster than two fighting
# over OpenMP barriers (measured). Subprocesses (Ray workers) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray must bind and advertise loopback only in tests.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import torch  # noqa: E402  (after the environment above)

torch.set_num_threads(1)

# A real redis-server per test session (tests/fixtures_redis.py).
pytest_plugins = ["fixtures_redis"]
