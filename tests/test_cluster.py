"""`pagedserve up` for real: a local Ray, the router, worker actors that Ray restarts.

One Ray instance and one cluster for the module (Ray costs seconds and ~1 GiB to
start); each test leaves the cluster quiescent for the next.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time

import grpc
import psutil
import pytest
import ray
from builders import tiny_checkpoint

from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.common.core.llm import LLM
from pagedserve.kvtransfer import faults
from pagedserve.launch import Cluster, ClusterSpec
from pagedserve.router.client import Client
from pagedserve.v1 import worker_pb2

MAX_TOKENS = 16
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# The decode worker that test_scale_up_then_down_while_streams_run adds, then drains, is
# slowed (kvtransfer/faults.py, read by each actor from the environment Ray inherits):
# its 200-token streams take 4 s at least, so they still run when it is told to leave,
# on any machine. A fault spec set by the caller (the slow mode) takes precedence.
SLOW_LEAVER = "delay_rpc=Engine.step:20,only=decode-1"


@pytest.fixture(scope="module")
def cluster():
    saved = os.environ.get(faults.ENV)
    os.environ.setdefault(faults.ENV, SLOW_LEAVER)
    try:
        yield from _cluster()
    finally:
        if saved is None:
            os.environ.pop(faults.ENV, None)


def _cluster():
    ckpt = str(tiny_checkpoint("llama"))
    spec = ClusterSpec(
        model=ckpt,
        num_prefill=2,
        num_decode=1,
        engine=EngineConfig(
            dtype="float32",
            cache=CacheConfig(num_blocks=128),
            scheduler=SchedulerConfig(max_model_len=256),
            num_threads=1,
        ),
        router_port=0,
        internal_port=0,
        num_cpus=2,
        heartbeat_interval_s=0.2,
        worker_timeout_s=1.5,
        log_level="WARNING",
    )
    c = Cluster(spec).start(progress=lambda _msg: None, timeout_s=180)
    yield c
    c.stop()
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def reference():
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", num_blocks=64, max_model_len=256)
    return lambda ids: llm.generate([ids], SamplingParams(**GREEDY))[0].completions[0].token_ids


def prompt(seed: int, n: int = 40) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def tokens_of(client: Client, ids: list[int]) -> list[int]:
    out: list[int] = []
    for resp in client.generate(token_ids=ids, **GREEDY):
        out += resp.token_ids
    return out


def worker_stats(actor) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats.FromString(ray.get(actor.stats.remote(), timeout=30))


def wait_quiescent(cluster: Cluster, timeout: float = 10.0) -> None:
    """Every worker: no block held, no lease open, invariants hold."""
    deadline = time.monotonic() + timeout
    while True:
        stats = [worker_stats(a) for a in cluster.prefill + cluster.decode]
        if all(s.kv_usage == 0 and s.open_leases == 0 for s in stats):
            break
        assert time.monotonic() < deadline, f"workers still busy: {stats}"
        time.sleep(0.1)
    for actor in cluster.prefill + cluster.decode:
        assert ray.get(actor.check_integrity.remote(), timeout=30)


def test_only_loopback_listens(cluster):
    """Ray, the router and the workers listen on 127.0.0.1 only."""
    me = psutil.Process(os.getpid())
    pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
    listening = [
        c
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]
    assert listening, "found no listening socket at all: the check itself is broken"
    exposed = [c.laddr for c in listening if not _is_loopback(c.laddr.ip)]
    assert not exposed, f"listening beyond loopback: {exposed}"


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or addr).is_loopback


def test_greedy_through_ray_cluster_equals_engine(cluster, reference):
    with Client(cluster.address, timeout=60) as client:
        for seed in range(3):
            ids = prompt(seed)
            assert tokens_of(client, ids) == reference(ids)
    wait_quiescent(cluster)


def test_concurrent_streams_complete_and_pools_return(cluster, reference):
    ids = [prompt(10 + i, 20 + 3 * i) for i in range(12)]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        with Client(cluster.address, timeout=120) as client:
            results[i] = tokens_of(client, ids[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == list(range(len(ids)))
    for i, p in enumerate(ids):
        assert results[i] == reference(p)
    wait_quiescent(cluster)


def test_killed_prefill_worker_is_routed_around_and_restarted(cluster, reference):
    victim = cluster.prefill[0]
    old_pid = ray.get(victim.pid.remote(), timeout=30)
    errors: list[grpc.StatusCode] = []
    done: list[list[int]] = []

    def run(i: int) -> None:
        try:
            with Client(cluster.address, timeout=120) as client:
                done.append(tokens_of(client, prompt(100 + i)))
        except grpc.RpcError as e:
            errors.append(e.code())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    ray.kill(victim, no_restart=False)  # a crash: Ray restarts the actor
    for t in threads:
        t.join(180)
    # In-flight requests either completed (retry / fallback) or ended UNAVAILABLE.
    assert len(done) + len(errors) == 6
    assert set(errors) <= {grpc.StatusCode.UNAVAILABLE}
    # New requests route around the dead worker meanwhile.
    with Client(cluster.address, timeout=60) as client:
        ids = prompt(200)
        assert tokens_of(client, ids) == reference(ids)
    # Ray restarts it (a new process) and it registers again under its worker id.
    deadline = time.monotonic() + 120
    while True:
        try:
            new_pid = ray.get(victim.pid.remote(), timeout=60)
            break
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline, "the actor never came back"
            time.sleep(0.5)
    assert new_pid != old_pid
    cluster.wait_registered(timeout_s=30)
    assert "prefill-0" in cluster.router.live_worker_ids()
    wait_quiescent(cluster)


def test_scale_up_then_down_while_streams_run(cluster, reference):
    """`pagedserve scale`: a new decode worker registers and serves; the leaving one
    drains, so the streams it holds finish (none fails) before it stops."""
    import io
    import json

    from pagedserve import admin_cli

    address = cluster.router.router.internal_address

    def cli(cmd: str, *args: str) -> str:
        out = io.StringIO()
        assert admin_cli.main(cmd, [*args, "--address", address], out=out) == 0
        return out.getvalue()

    assert cli("scale", "--decode", "2") == "now 2 prefill + 2 decode worker(s); started decode-1\n"
    status = json.loads(cli("status", "--json"))
    assert status["scalable"] is True
    assert [w["worker_id"] for w in status["workers"]] == [
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
    ]
    # Streams long enough to be running on both decode workers when decode-1 leaves.
    prompts = [prompt(300 + i, 30) for i in range(4)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(len(prompts) + 1)

    def run(i: int) -> None:
        try:
            with Client(cluster.address, timeout=120) as client:
                out: list[int] = []
                for n, resp in enumerate(
                    client.generate(
                        token_ids=prompts[i], temperature=0.0, max_tokens=200, ignore_eos=True
                    )
                ):
                    out += resp.token_ids
                    if n == 0:
                        started.wait(60)
                results[i] = out
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait(60)
    leaving = cluster.decode[1]
    assert worker_stats(leaving).num_running > 0, "no stream on the leaving worker"  # slowed
    summary = cli("scale", "--decode", "1", "--drain-timeout-s", "60")
    assert summary == "now 2 prefill + 1 decode worker(s); stopped decode-1\n"  # none cut
    for t in threads:
        t.join(180)
    assert not errors
    assert sorted(results) == list(range(len(prompts)))
    assert all(len(toks) == 200 for toks in results.values())
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(leaving.pid.remote(), timeout=30)
    assert sorted(cluster.router.live_worker_ids()) == ["decode-0", "prefill-0", "prefill-1"]
    with Client(cluster.address, timeout=60) as client:
        ids = prompt(400)
        assert tokens_of(client, ids) == reference(ids)
    wait_quiescent(cluster)
