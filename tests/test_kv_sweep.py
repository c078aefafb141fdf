"""A worker killed on the way out (its stop hung, or it had died) never closed its KV
cache, whose /dev/shm file then holds tmpfs memory the size of the cache; the launcher
sweeps dead processes' KV files on every Ray node once such a worker is gone
(pagedserve/launch.py `stop_workers`, `sweep_stale_kv_files`; common/shm.py
`remove_stale_kv_files_in`). A real local Ray and a real actor that hangs in `stop`; a
temporary directory stands in for /dev/shm."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import pytest

from pagedserve.common import shm


def dead_pid() -> int:
    proc = mp.get_context("spawn").Process(target=os.getpid)
    proc.start()
    proc.join()
    return proc.pid


def kv_files(d: Path, pid: int) -> list[Path]:
    """A KV cache file, a segment and a half-written segment of process `pid`."""
    paths = [
        d / f"{shm.KV_CACHE_FILE_PREFIX}{pid}-0123456789abcdef",
        d / f"{shm.KV_SEGMENT_PREFIX}{pid}-lease1",
        d / f"{shm.KV_SEGMENT_PREFIX}{pid}-pool-ab12-3.tmp",
    ]
    for p in paths:
        p.write_bytes(b"kv" * 100)
    return paths


def test_remove_stale_kv_files_in_takes_dead_processes_files_only(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    dead = dead_pid()
    stale = kv_files(a, dead) + kv_files(b, dead)
    mine = kv_files(a, os.getpid())  # a live process's: kept
    other = [a / f"unrelated-{dead}-file", a / f"{shm.KV_CACHE_FILE_PREFIX}{dead}-short"]
    for p in other:
        p.write_bytes(b"x")
    missing = str(tmp_path / "no-such-dir")
    removed = shm.remove_stale_kv_files_in([str(a), str(b), str(a), missing])
    assert removed == sorted(str(p) for p in stale)
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in mine + other)


class HangsInStop:
    """A worker stand-in: it holds KV files named for its own pid, and its `stop` never
    returns (a worker stuck in its engine, say)."""

    def __init__(self, shm_dir: str) -> None:
        self.paths = [str(p) for p in kv_files(Path(shm_dir), os.getpid())]

    def files(self) -> list[str]:
        return self.paths

    def stop(self) -> None:
        time.sleep(3600)


class StopsCleanly:
    def stop(self) -> None:
        return None


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    from pagedserve.launch import init_local_ray

    # The actor classes above travel by value: Ray's workers cannot import this module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    init_local_ray(num_cpus=1, include_dashboard=False, object_store_memory=80 << 20)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_a_worker_killed_at_stop_has_its_kv_files_swept(local_ray, tmp_path):
    from pagedserve.launch import stop_workers

    ray = local_ray
    mine = kv_files(tmp_path, os.getpid())  # this live process's: a sweep keeps them
    stuck = ray.remote(num_cpus=0)(HangsInStop).remote(str(tmp_path))
    paths = [Path(p) for p in ray.get(stuck.files.remote(), timeout=60)]
    assert paths and all(p.exists() for p in paths)
    stop_workers([stuck], timeout_s=2.0, shm_dirs=[str(tmp_path)])
    assert not any(p.exists() for p in paths), "the killed worker's KV files are left"
    assert all(p.exists() for p in mine)


def test_clean_stops_sweep_nothing(local_ray, tmp_path):
    """Workers that stopped themselves closed their files: no sweep runs (a stop stays
    as fast as before), so even a dead process's file is left to the next worker start."""
    from pagedserve.launch import stop_workers

    ray = local_ray
    leftover = kv_files(tmp_path, dead_pid())
    worker = ray.remote(num_cpus=0)(StopsCleanly).remote()
    ray.get(worker.__ray_ready__.remote(), timeout=60)
    stop_workers([worker], timeout_s=10.0, shm_dirs=[str(tmp_path)])
    assert all(p.exists() for p in leftover)


def test_cluster_sweeps_where_its_workers_keep_kv_files():
    from dataclasses import replace

    from pagedserve.common.core.config import CacheConfig, EngineConfig
    from pagedserve.launch import Cluster, ClusterSpec

    assert Cluster(ClusterSpec()).kv_shm_dirs() == [str(shm.SHM_DIR)]
    spec = ClusterSpec(
        worker_options={"kv_shm_dir": "/mnt/kv"},
        engine=replace(EngineConfig(), cache=CacheConfig(shm_dir="/mnt/cache")),
    )
    assert Cluster(spec).kv_shm_dirs() == ["/mnt/kv", "/mnt/cache"]
