"""Stopping gracefully, and restarting the router on its own (issue 10, section 2).

`pagedserve up` runs as a real subprocess here (a tiny fp32 checkpoint, loopback
ports), signalled as Kubernetes and systemd do. Streams are held "in flight" by
clients that stop reading: with a 1-byte HTTP/2 window (`SLOW_READER`) the router's
writes wait for the client, so a stream lasts exactly as long as the test wants,
whatever the speed of the machine.

Processes are only ever signalled by the PIDs the tests learned (the launcher and its
process tree), never by name.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from builders import tiny_checkpoint
from fixtures_redis import free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router_fixtures import ROUTER_CONFIG, start_cluster, tiny_engine_config, wait_for

from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.runtime.protocol import sampling_to_pb
from pagedserve.common.runtime.worker import WorkerConfig
from pagedserve.router.client import build_request
from pagedserve.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pagedserve.worker import start_worker

REPO = Path(__file__).resolve().parents[1]
SLOW_READER = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
MAX_TOKENS = 200  # + a 20-token prompt: within the tiny model's 256/512 positions
SHUTTING_DOWN = "router is shutting down"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def prompt(seed: int, n: int = 20) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


class Stream:
    """A greedy Generate whose client reads only when told to."""

    def __init__(self, address: str, seed: int, max_tokens: int = MAX_TOKENS) -> None:
        self.channel = grpc.insecure_channel(address, options=SLOW_READER)
        req = build_request(
            token_ids=prompt(seed), max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        self.call = generation_pb2_grpc.GenerationStub(self.channel).Generate(req, timeout=120)
        self.tokens = len(next(self.call).token_ids)  # the router is streaming it now

    def rest(self) -> int:
        """Reads to the end; returns the completion's token count (raises RpcError)."""
        try:
            for r in self.call:
                self.tokens += len(r.token_ids)
        finally:
            self.channel.close()
        return self.tokens


def generate(address: str, seed: int, max_tokens: int = 8) -> int:
    with grpc.insecure_channel(address) as ch:
        req = build_request(
            token_ids=prompt(seed), max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        stub = generation_pb2_grpc.GenerationStub(ch)
        return sum(len(r.token_ids) for r in stub.Generate(req, timeout=60))


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def refused_while_draining(address: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        generate(address, seed=99)
    return e.value


# -- the router alone, in process: drain() -----------------------------------------------


def test_drain_finishes_streams_refuses_new_cuts_late_ones_and_frees_blocks():
    c = start_cluster(ROUTER_CONFIG, {"prefill": 1, "decode": 1})
    try:
        done, late = Stream(c.address, seed=1), Stream(c.address, seed=2)
        cut: list[int] = []
        # The grace period only has to outlast the "done" stream's 200 tokens on a slow
        # host ("late" is never read, so it is cut at the end of any grace period): 3 s
        # once did not, in a CI run on a 2-core host whose speed drifted (2026-12-02).
        drain = threading.Thread(target=lambda: cut.append(c.router.drain(10.0)))
        drain.start()
        wait_for(lambda: health(c.address) == NOT_SERVING, what="health NOT_SERVING")
        for service in ("pagedserve.prefill", "pagedserve.decode"):
            with grpc.insecure_channel(c.address) as ch:
                req = health_pb2.HealthCheckRequest(service=service)
                assert health_pb2_grpc.HealthStub(ch).Check(req).status == NOT_SERVING
        e = refused_while_draining(c.address)
        assert e.code() == grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in e.details()
        assert done.rest() == MAX_TOKENS  # in flight before the drain: served in full
        drain.join(30)
        assert cut == [1]
        with pytest.raises(grpc.RpcError) as e:
            late.rest()  # still open when the grace period ended
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "10 s shutdown grace period" in e.value.details()
        assert late.tokens < MAX_TOKENS
        c.wait_quiescent()  # the cut stream's blocks are back, no lease left
        assert c.router.call(lambda r: r.counters["refused_draining"]) == 1
    finally:
        c.stop()


# -- python -m pagedserve.router, workers on their own -----------------------------------


def start_router_process(
    workdir: Path, name: str, port: int, internal_port: int
) -> subprocess.Popen:
    args = ["--model", str(tiny_checkpoint("llama")), "--port", str(port)]
    args += ["--internal-port", str(internal_port)]
    args += ["--shutdown-grace-s", "10", "--worker-timeout-s", "30", "--log-level", "WARNING"]
    args += ["--no-http"]  # routers here restart on one address; HTTP is test_openai_api's
    with open(workdir / f"{name}.err", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "pagedserve.router", *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            start_new_session=True,
        )


def serving(address: str) -> bool:
    try:
        return health(address) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def test_standalone_router_drains_and_its_workers_join_the_next_one(tmp_path):
    """Workers started on their own (not by the router) outlive it: a new router on
    the same address gets their heartbeats, and what the old one left open returns."""
    port, internal_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    internal = f"127.0.0.1:{internal_port}"  # the workers' side: registry and index
    routers = [start_router_process(tmp_path, "router-1", port, internal_port)]
    workers = []
    try:
        for wid, pool in (("p0", "prefill"), ("d0", "decode")):
            cfg = WorkerConfig(
                worker_id=wid,
                pool=pool,
                engine=tiny_engine_config(),
                registry_address=internal,
                index_address=internal,
                heartbeat_interval_s=0.2,
                lease_ttl_s=2.0,
            )
            workers.append(start_worker(cfg))
        wait_for(lambda: serving(address), timeout=120, what="router 1 to route")
        stream = Stream(address, seed=4)
        orphan_lease(workers[0].address)  # the router dies before anyone pulls it
        routers[0].send_signal(signal.SIGTERM)
        wait_for(lambda: health(address) == NOT_SERVING, timeout=30, what="NOT_SERVING")
        e = refused_while_draining(address)
        assert e.code() == grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in e.details()
        assert stream.rest() == MAX_TOKENS
        assert routers[0].wait(timeout=60) == 0
        err = (tmp_path / "router-1.err").read_text()
        assert "Traceback" not in err, err

        routers.append(start_router_process(tmp_path, "router-2", port, internal_port))
        wait_for(lambda: serving(address), timeout=120, what="the workers to join router 2")
        assert generate(address, seed=5) == 8
        wait_for(
            lambda: all(
                w.loop.call(lambda e: e.block_manager.usage()) == 0 and not w.kv_source.open_leases
                for w in workers
            ),
            timeout=20,
            what="blocks and leases to return",
        )
        assert workers[0].kv_source.expired_total == 1  # the orphan lease, by its TTL
        for w in workers:
            w.check_integrity()
        routers[1].send_signal(signal.SIGTERM)
        assert routers[1].wait(timeout=60) == 0
    finally:
        for w in workers:
            w.stop(grace=0.5)
        for r in routers:
            if r.poll() is None:
                r.kill()
                r.wait(30)


# -- `pagedserve up` as a subprocess ------------------------------------------------------


class Launcher:
    """`pagedserve up ARGS` in a subprocess, its output in files."""

    def __init__(self, workdir: Path, name: str, args: list[str]) -> None:
        self.out_path = workdir / f"{name}.out"
        self.err_path = workdir / f"{name}.err"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.cli", "up", *args],
                stdout=out,
                stderr=err,
                env=env,
                cwd=REPO,
                start_new_session=True,  # its own process group, as a shell job has
            )
        self.started: list[psutil.Process] = []  # its process tree, once serving

    def stdout(self) -> str:
        return self.out_path.read_text()

    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_serving(self, timeout: float = 240.0) -> str:
        """The router's address, once the launcher says it serves."""
        deadline = time.monotonic() + timeout
        while (m := re.search(r"serving on (\S+)", self.stdout())) is None:
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited {self.proc.returncode}:\n{self.stderr()}")
            assert time.monotonic() < deadline, f"launcher never served:\n{self.stderr()}"
            time.sleep(0.1)
        self.started = [psutil.Process(self.proc.pid), *self.descendants()]
        return m.group(1)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def ctrl_c(self) -> None:
        """SIGINT to its process group, as a terminal's Ctrl-C does (Ray's daemons
        get it too)."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait_exit(self, timeout: float = 120.0) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL to the launcher and every process it started (by PID)."""
        for p in [*self.descendants(), *self.started]:
            if running(p):
                p.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def running(p: psutil.Process) -> bool:
    """Alive (a zombie, waiting for a parent that already exited, is not)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_clean_exit(up: Launcher, rc: int) -> None:
    err = up.stderr()
    assert rc == 0, err
    for bad in ("Traceback", "SIGTERM received", "Aborted", "core dumped"):
        assert bad not in err, err
    wait_for(
        lambda: not any(running(p) for p in up.started),
        timeout=30,
        what=f"the processes it started to exit: {[p.pid for p in up.started if running(p)]}",
    )


@pytest.fixture
def launch(tmp_path: Path) -> Iterator:
    """A factory of Launchers; whatever they left running is killed by PID at teardown."""
    launched: list[Launcher] = []

    def start(name: str, args: list[str]) -> Launcher:
        up = Launcher(tmp_path, name, args)
        launched.append(up)
        return up

    yield start
    for up in launched:
        up.kill()


def tiny_args(*extra: str) -> list[str]:
    return [
        "--no-http",  # several launchers in a row: no fixed HTTP port (test_openai_api's)
        "--model",
        str(tiny_checkpoint("llama")),
        "--dtype",
        "float32",
        "--kv-cache-gib",
        "0.01",
        "--threads-per-worker",
        "1",
        "--log-level",
        "WARNING",
        "--internal-port",  # a fixed one (the default) could collide with another run
        "0",
        *extra,
    ]


def test_sigterm_drains_in_flight_streams_and_exits_0(launch, redis_server_factory):
    from pagedserve.common.runtime.prefix_index.worker_registry import (
        TOMBSTONE,
        RedisWorkerRegistry,
    )

    redis_url = redis_server_factory.start().url
    up = launch(
        "up", tiny_args("--port", "0", "--shutdown-grace-s", "120", "--redis-url", redis_url)
    )
    address = up.wait_serving()
    assert len(up.started) > 3, "expected Ray's daemons and two workers under the launcher"
    done, late = Stream(address, seed=1), Stream(address, seed=2)
    up.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: health(address) == NOT_SERVING, timeout=30, what="health NOT_SERVING")
    e = refused_while_draining(address)
    assert e.code() == grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in e.details()
    assert done.rest() == MAX_TOKENS  # the stream in flight completes in full
    # The other stream's client does not read; a second SIGTERM ends the grace period
    # (120 s) now, and with it that stream.
    up.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "grace period over" in up.stderr(), timeout=60, what="the grace to end")
    with pytest.raises(grpc.RpcError) as cut:
        late.rest()
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "grace period was ended early" in cut.value.details()
    assert_clean_exit(up, up.wait_exit())
    assert "SIGTERM: draining" in up.stderr()
    # The workers said goodbye: their Redis registry entries are tombstones.
    registry = RedisWorkerRegistry(redis_url)
    try:
        assert registry.read() == {"prefill-0": TOMBSTONE, "decode-0": TOMBSTONE}
    finally:
        registry.close()


def test_ctrl_c_drains_too(launch):
    up = launch("up", tiny_args("--port", "0"))
    address = up.wait_serving()
    stream = Stream(address, seed=3)
    up.ctrl_c()
    wait_for(lambda: health(address) == NOT_SERVING, timeout=30, what="health NOT_SERVING")
    e = refused_while_draining(address)
    assert e.code() == grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in e.details()
    assert stream.rest() == MAX_TOKENS
    assert_clean_exit(up, up.wait_exit())
    assert "SIGINT: draining" in up.stderr()


def test_sigterm_while_workers_start_exits_0(launch):
    up = launch("up", tiny_args("--port", "0"))
    # Workers start in new processes that import torch and load the model: seconds.
    wait_for(lambda: "loading the model" in up.stderr(), timeout=120, what="workers to start")
    up.started = [psutil.Process(up.proc.pid), *up.descendants()]
    up.proc.send_signal(signal.SIGTERM)
    assert_clean_exit(up, up.wait_exit())
    assert "SIGTERM while starting up" in up.stderr()


# -- the router restarts alone; detached workers stay ------------------------------------


@pytest.fixture
def ray_cluster() -> Iterator[tuple[str, str]]:
    """A Ray cluster that outlives the launchers (held by this process): its GCS address
    and a fresh namespace. The workers left in it are killed at teardown."""
    import ray

    assert not ray.is_initialized()
    namespace = f"lifecycle-{uuid.uuid4().hex[:8]}"
    from pagedserve.launch import init_local_ray

    ctx = init_local_ray(
        num_cpus=2,
        include_dashboard=False,
        namespace=namespace,
        object_store_memory=100 << 20,
    )
    try:
        yield ctx.address_info["gcs_address"], namespace
    finally:
        for name in ray.util.list_named_actors(all_namespaces=False):
            ray.kill(ray.get_actor(name), no_restart=True)
        ray.shutdown()


def actor(name: str):
    import ray

    return ray.get_actor(name)


def worker_info(name: str) -> dict:
    import ray

    return ray.get(actor(name).describe.remote(), timeout=60)


def worker_stats(name: str) -> worker_pb2.WorkerStats:
    import ray

    return worker_pb2.WorkerStats.FromString(ray.get(actor(name).stats.remote(), timeout=60))


def orphan_lease(prefill_address: str) -> str:
    """A Prefill whose KV handle nobody will consume: what a router that dies between
    Prefill and Decode leaves behind. No TTL in the request: the worker's default."""
    req = worker_pb2.TokenizedRequest(
        request_id="orphan",
        prompt_token_ids=prompt(7, n=40),
        sampling=sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=4)),
    )
    with grpc.insecure_channel(prefill_address) as ch:
        handle = worker_pb2_grpc.PrefillStub(ch).Prefill(
            worker_pb2.PrefillRequest(request=req), timeout=60
        )
    assert handle.lease_id
    return handle.lease_id


def test_router_restarts_alone_and_detached_workers_register_again(launch, ray_cluster):
    import ray

    gcs, namespace = ray_cluster
    port = free_port()
    args = tiny_args(
        "--port",
        str(port),
        "--ray-address",
        gcs,
        "--ray-namespace",
        namespace,
        "--detach-workers",
        "--lease-ttl-s",
        "3",
        "--internal-port",  # fixed: the detached workers dial it again after the restart
        str(free_port()),
    )
    names = ["pagedserve-prefill-0", "pagedserve-decode-0"]
    first = launch("up-1", args)
    address = first.wait_serving()
    assert generate(address, seed=1) == 8
    pids = {n: worker_info(n)["pid"] for n in names}
    streams = [Stream(address, seed=10 + i) for i in range(2)]
    orphan_lease(worker_info("pagedserve-prefill-0")["address"])
    assert worker_stats("pagedserve-prefill-0").open_leases == 1

    first.proc.kill()  # the router crashes (or its pod is deleted): no drain at all
    first.wait_exit()
    for s in streams:
        with pytest.raises(grpc.RpcError) as e:
            s.rest()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # The workers live on; the dead router's streams were cancelled with its
    # connections, and its unconsumed lease expires by the TTL the launcher gave the
    # workers (3 s; well before the 30 s default this timeout stays under).
    assert WorkerConfig.lease_ttl_s >= 30
    wait_for(
        lambda: all(
            worker_stats(n).kv_usage == 0 and not worker_stats(n).open_leases for n in names
        ),
        timeout=20,
        what="blocks and leases of the dead router's requests to return",
    )
    assert worker_stats("pagedserve-prefill-0").expired_leases_total == 1
    for n in names:
        assert ray.get(actor(n).check_integrity.remote(), timeout=60)
        assert worker_info(n)["pid"] == pids[n]

    second = launch("up-2", args)  # the same command, as a rollout restarts it
    assert second.wait_serving() == address
    assert generate(address, seed=2) == 8
    for n in names:  # attached, not started again: the same processes
        assert worker_info(n)["pid"] == pids[n]

    second.proc.send_signal(signal.SIGTERM)  # a graceful stop leaves detached workers be
    assert_clean_exit(second, second.wait_exit())
    assert "leaving the detached workers running" in second.stderr()
    for n in names:
        assert worker_info(n)["pid"] == pids[n]

    down = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "down", "--ray-address", gcs]
        + ["--ray-namespace", namespace],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert down.returncode == 0, down.stderr
    assert f"stopped 2 worker(s): {', '.join(sorted(names))}" in down.stdout
    assert "Traceback" not in down.stderr
    assert ray.util.list_named_actors(all_namespaces=False) == []
