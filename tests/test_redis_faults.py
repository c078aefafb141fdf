"""Redis must never silently break routing (issue 10, section 2).

Faults are made on real redis-servers (tests/fixtures_redis.py), each undone in the
fixture's teardown:

- READONLY: ``REPLICAOF`` a port nothing listens on: the server keeps its data,
  answers reads and refuses writes, as a replica after a failover does;
- OOM: ``CONFIG SET maxmemory 1`` with the ``noeviction`` policy;
- NOPERM: an ACL user whose ``+@write`` is taken away;
- a hung Redis: ``CLIENT PAUSE <ms> ALL`` (it accepts connections, answers nothing;
  a pause cannot be lifted from outside while it lasts, so it is short);
- malformed values written into registry and index keys.

Every client must turn each of them into a logged, counted, degraded state, keep its
loop alive, and recover by itself when Redis does.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from builders import one_torch_thread  # noqa: F401 (autouse fixture)
from fixtures_redis import RedisServer, free_port
from router_fixtures import ROUTER_CONFIG, Cluster, tiny_engine_config, wait_for

from pagedserve.common.runtime.prefix_index import IndexEvent, IndexPublisher, IndexUnavailableError
from pagedserve.common.runtime.prefix_index.faults import Backoff, LogLimiter
from pagedserve.common.runtime.prefix_index.redis import RedisPrefixIndex
from pagedserve.common.runtime.prefix_index.worker_registry import (
    RedisWorkerRegistry,
    RegistryPublisher,
)
from pagedserve.router.server import Router, start_router_in_thread
from pagedserve.v1 import worker_pb2

GREEDY = dict(temperature=0.0, ignore_eos=True)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


CHAIN = [h(i + 1) for i in range(6)]


class Fault:
    """Puts a redis-server into a fault state and takes it out again (``restore``)."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.admin = server.client()
        self.user: tuple[str, str] | None = None  # (name, password) of an ACL user made here
        self._paused_until = 0.0
        self._policy = self.admin.config_get("maxmemory-policy")["maxmemory-policy"]

    def user_url(self) -> str:
        """The server's URL as an ACL user with every right the clients need."""
        name, password = f"ps-{uuid.uuid4().hex[:8]}", "pw"
        self.admin.acl_setuser(
            name,
            enabled=True,
            passwords=[f"+{password}"],
            keys=["ps:*"],
            commands=[
                "+@read",
                "+@write",
                "+@scripting",
                "+@transaction",
                "+ping",
                "+client|setname",
            ],
        )
        self.user = (name, password)
        return f"redis://{name}:{password}@127.0.0.1:{self.server.port}/0"

    def inject(self, kind: str) -> None:
        if kind == "readonly":  # a master that does not exist: data kept, writes refused
            self.admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        elif kind == "oom":
            self.admin.config_set("maxmemory-policy", "noeviction")
            self.admin.config_set("maxmemory", "1")
        elif kind == "noperm":
            assert self.user is not None, "user_url() first"
            self.admin.acl_setuser(self.user[0], commands=["-@write"])
        else:
            raise ValueError(kind)

    def pause(self, ms: int) -> None:
        self.admin.execute_command("CLIENT", "PAUSE", ms, "ALL")
        self._paused_until = time.monotonic() + ms / 1000

    def restore(self) -> None:
        # CLIENT UNPAUSE is itself held back while a PAUSE ALL lasts: wait it out.
        time.sleep(max(0.0, self._paused_until - time.monotonic()))
        self.admin.execute_command("CLIENT", "UNPAUSE")
        self.admin.execute_command("REPLICAOF", "NO", "ONE")
        self.admin.config_set("maxmemory", "0")
        self.admin.config_set("maxmemory-policy", self._policy)
        if self.user is not None:
            self.admin.acl_setuser(self.user[0], commands=["+@write"])


@pytest.fixture
def fault(redis_server_factory) -> Iterator[Fault]:
    """A dedicated server (faults change server-wide state) and its fault switch."""
    f = Fault(redis_server_factory.start())
    try:
        yield f
    finally:
        f.restore()
        if f.user is not None:
            f.admin.acl_deluser(f.user[0])
        f.admin.close()


def stats(worker_id: str, ts: int = 1, model: str = "m@0") -> bytes:
    return worker_pb2.WorkerStats(
        worker_id=worker_id,
        pool=worker_pb2.WORKER_POOL_DECODE,
        address="127.0.0.1:1",
        model_name=model,
        timestamp_unix_ms=ts,
    ).SerializeToString()


# ---- backoff and log limits, without Redis ---------------------------------------------


def test_backoff_is_exponential_capped_jittered_and_counts_from_the_end_of_the_call():
    now = [100.0]
    jitter = iter([1.0, 1.0, 0.0, 1.0, 1.0])
    b = Backoff(1.0, 4.0, clock=lambda: now[0], rng=lambda: next(jitter))
    assert b.ready()
    now[0] = 105.0  # the failed call started at 100 and returned at 105
    assert b.failed() == 1.0 and b.retry_at == 106.0 and not b.ready()
    assert b.failed() == 2.0 and b.retry_at == 107.0
    assert b.failed() == 2.0  # nominal 4, jittered down to half at most
    assert b.failed() == 4.0 and b.failed() == 4.0  # capped
    b.succeeded()
    assert b.ready() and b.failures == 0
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)


def test_log_limiter_says_each_kind_once_per_period(caplog):
    import logging

    now = [0.0]
    log = LogLimiter(logging.getLogger("faults-test"), every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="faults-test"):
        assert log.log(logging.WARNING, "a", "first %d", 1)
        assert not log.log(logging.WARNING, "a", "again")
        assert log.log(logging.WARNING, "b", "another kind")
        now[0] = 11.0
        assert log.log(logging.WARNING, "a", "later")
    assert [r.getMessage() for r in caplog.records] == [
        "first 1",
        "another kind",
        "later (1 more like it in the last 11 s)",
    ]


# ---- every error class, at the client level ---------------------------------------------


@pytest.mark.parametrize(
    ("kind", "word"),
    [
        ("readonly", "ReadOnlyError"),
        ("oom", "OutOfMemoryError"),
        ("noperm", "can.t run this command|NoPermissionError"),
    ],
)
def test_every_redis_error_class_degrades_and_recovers(fault: Fault, kind: str, word: str):
    url = fault.user_url()
    index = RedisPrefixIndex(url, "faults")
    cached: set[bytes] = set()
    publisher = IndexPublisher(index, "w0", snapshot=lambda: sorted(cached), ttl_s=60)
    beats = RegistryPublisher(url, "w0", ttl_s=60, retry_s=0.05, max_retry_s=0.1)
    registry = RedisWorkerRegistry(url)
    try:
        cached.update(CHAIN[:2])
        assert publisher.tick() and beats.beat(stats("w0"))
        assert set(registry.read()) == {"w0"}

        fault.inject(kind)
        with pytest.raises(IndexUnavailableError, match=word):
            index.heartbeat("w0", 60)
        with pytest.raises(IndexUnavailableError, match=word):
            registry.read()  # the probe write fails: the router keeps its view
        cached.update(CHAIN[2:4])
        assert publisher.publish([IndexEvent.stored(h) for h in CHAIN[2:4]]) is False
        assert publisher.degraded and publisher.needs_resync
        assert beats.beat(stats("w0", ts=2)) is False
        assert beats.degraded and beats.failures == 1

        fault.restore()
        wait_for(lambda: beats.beat(stats("w0", ts=3)), what="a beat once its backoff passed")
        assert not beats.degraded
        assert publisher.tick() and not publisher.degraded
        assert index.worker_hashes("w0") == cached
        assert index.match(CHAIN) == {"w0": 4}
        assert registry.read() == {"w0": stats("w0", ts=3)}
    finally:
        for client in (index, registry, beats.registry):
            client.close()


def test_backoff_after_a_hung_call_counts_from_its_end(fault: Fault):
    beats = RegistryPublisher(fault.server.url, "w0", ttl_s=60, retry_s=1.0, max_retry_s=1.0)
    timeout_s = 0.5  # the registry's socket timeout (connection.py)
    try:
        assert beats.beat(stats("w0"))
        fault.pause(1500)
        started = time.monotonic()
        assert beats.beat(stats("w0", ts=2)) is False  # timed out (twice: one retry)
        # Jitter keeps at least half of the 1 s: due no sooner than 0.5 s after the
        # call *returned*, which was at least one socket timeout after it started.
        assert beats.backoff.retry_at >= started + timeout_s + 0.5
        assert beats.beat(stats("w0", ts=3)) is False and beats.failures == 1  # not due yet
    finally:
        beats.registry.close()


# ---- malformed values -----------------------------------------------------------------


def test_malformed_index_entries_are_skipped_not_fatal(fault: Fault):
    index = RedisPrefixIndex(fault.server.url, "bad")
    cached = set(CHAIN[:3])
    publisher = IndexPublisher(index, "A", snapshot=lambda: sorted(cached), ttl_s=60)
    admin, p = fault.admin, "ps:{bad}:"
    try:
        assert publisher.tick()
        index.heartbeat("B", 60)
        index.resync("B", CHAIN[:1], 0)
        admin.sadd(f"{p}workers", b"\xff\xfe")  # a worker id that is not UTF-8, alive
        admin.set(f"{p}alive:".encode() + b"\xff\xfe", b"1")
        admin.sadd(f"{p}w:A", "not-a-hash")
        admin.delete(f"{p}h:{CHAIN[1].hex()}")
        admin.set(f"{p}h:{CHAIN[1].hex()}", "a string where a set belongs")

        assert index.workers() == ["A", "B"]
        assert index.match(CHAIN) == {"A": 1, "B": 1}  # the overwritten block: held by none
        assert index.worker_hashes("A") == set(CHAIN[:3])

        admin.hset(f"{p}m:A", "next", "garbage")
        with pytest.raises(IndexUnavailableError, match="malformed state"):
            index.worker_state("A")
        # The apply script cannot read it either: the publisher resyncs, which rewrites it.
        assert publisher.publish([IndexEvent.stored(CHAIN[3])]) is False
        cached.add(CHAIN[3])
        assert publisher.tick()
        assert index.worker_state("A").needs_resync is False
        assert index.worker_hashes("A") == set(CHAIN[:4])
    finally:
        index.close()


def test_malformed_registry_entries_are_skipped_and_the_rest_applied(fault: Fault):
    from builders import tiny_checkpoint

    model = str(tiny_checkpoint("llama"))
    config = dataclasses.replace(ROUTER_CONFIG, model=model, redis_url=fault.server.url)
    router = Router(config)
    router.redis_registry = RedisWorkerRegistry(fault.server.url)
    router.registry.listeners.clear()  # not started: no health service to update
    name = f"{router.frontend.model_name}@0123456789abcdef"
    admin, p = fault.admin, "ps:{registry}:"
    good = RegistryPublisher(fault.server.url, "good", ttl_s=60)
    try:
        assert good.beat(stats("good", model=name))
        admin.set(f"{p}w:garbage", b"\x08\x96\x01 not a WorkerStats", px=60_000)
        admin.set(f"{p}w:impostor", stats("someone-else", model=name), px=60_000)
        admin.hset(f"{p}w:wrongtype", "a", "hash")
        admin.sadd(f"{p}workers", "garbage", "impostor", "wrongtype", b"\xff\xfe")
        admin.set(f"{p}w:".encode() + b"\xff\xfe", stats("x", model=name), px=60_000)

        assert router.poll_redis_registry() is True
        assert [w.worker_id for w in router.registry.workers()] == ["good"]
        assert router.counters["registry_malformed"] == 2  # garbage, impostor
        assert router.counters["registry_unavailable"] == 0
    finally:
        good.goodbye()
        router.redis_registry.close()


# ---- a router and a worker that know each other only through Redis ----------------------

WORKER_TIMEOUT_S = 1.5
ROUTER = dataclasses.replace(ROUTER_CONFIG, worker_timeout_s=WORKER_TIMEOUT_S)


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-faults"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(redis_module: RedisServer) -> Iterator[Cluster]:
    """Router + one decode worker (it prefills locally). No gRPC registry: the router
    learns of the worker from Redis only, so a Redis fault is the router's only news."""
    engine = tiny_engine_config()
    config = dataclasses.replace(ROUTER, model=engine.model, redis_url=redis_module.url)
    c = Cluster(start_router_in_thread(config), engine)
    try:
        c.add_worker(
            "d0", "decode", registry_address=None, redis_url=redis_module.url, index_ttl_s=3.0
        )
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster_fault(cluster: Cluster, redis_module: RedisServer) -> Iterator[Fault]:
    """A fault on the cluster's Redis; restored, and the cluster healthy again, after."""
    f = Fault(redis_module)
    try:
        yield f
    finally:
        f.restore()
        f.admin.close()
        wait_recovered(cluster)


def generate(cluster: Cluster, seed: int, n: int = 24, max_tokens: int = 4) -> list[int]:
    ids = [(seed * 31 + i * 7) % 200 + 3 for i in range(n)]
    with cluster.client(timeout=60) as c:
        (got,) = c.collect(token_ids=ids, max_tokens=max_tokens, **GREEDY)
    return got.token_ids


def fed_timestamp(cluster: Cluster) -> int | None:
    return cluster.router.call(lambda r: r._redis_fed.get("d0"))


def threads_alive(cluster: Cluster) -> None:
    rt = cluster.workers["d0"]
    assert rt._heartbeat_thread is not None and rt._heartbeat_thread.is_alive()
    assert rt.index_sync._thread is not None and rt.index_sync._thread.is_alive()
    assert cluster.router.call(lambda r: not r._poller.done())


def wait_recovered(cluster: Cluster) -> None:
    """Fresh stats reach the router again and the index equals the worker's cache."""
    rt = cluster.workers["d0"]
    seen = fed_timestamp(cluster)
    wait_for(lambda: fed_timestamp(cluster) != seen, 15.0, "fresh stats from Redis")
    assert cluster.router.call(lambda r: not r._registry_outage)
    index = cluster.router.call(lambda r: r.prefix.index())

    def indexed() -> bool:
        try:
            return index.worker_hashes("d0") == set(
                rt.loop.call(lambda e: e.block_manager.cached_hashes())
            )
        except IndexUnavailableError:
            return False

    wait_for(indexed, 15.0, "the index to equal d0's cache")
    threads_alive(cluster)


@pytest.mark.parametrize("kind", ["readonly", "oom"])
def test_a_redis_refusing_writes_degrades_routing_but_never_stops_it(
    cluster: Cluster, cluster_fault: Fault, kind: str
):
    assert len(generate(cluster, 1)) == 4
    c0 = cluster.router.call(lambda r: dict(r.counters))
    cluster_fault.inject(kind)
    # Hold the fault for twice the router's worker timeout: the worker's stats in Redis
    # are frozen all along (its writes fail), yet it is never swept.
    end = time.monotonic() + 2 * WORKER_TIMEOUT_S
    served = 0
    while time.monotonic() < end or served < 2:
        assert len(generate(cluster, 10 + served)) == 4
        served += 1
        time.sleep(0.1)
    assert cluster.registered("d0")
    assert cluster.router.call(lambda r: r._registry_outage)
    c1 = cluster.router.call(lambda r: dict(r.counters))
    assert c1["registry_unavailable"] > c0.get("registry_unavailable", 0)
    rt = cluster.workers["d0"]
    assert rt.registry_publisher.degraded and rt.index_sync.publisher.degraded
    threads_alive(cluster)
    # Teardown restores Redis and checks that the worker reports again and resyncs.


REDIS_PY = os.path.dirname(redis.__file__) + os.sep  # redis-py's own source files


def redis_threads_during(seconds: float) -> set[str]:
    """Names of the threads seen inside redis-py (a Redis call) while sampling."""
    me = threading.get_ident()
    seen: set[str] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            f = frame
            while f is not None and ident != me:
                if f.f_code.co_filename.startswith(REDIS_PY):
                    seen.add(names.get(ident, "?"))
                    break
                f = f.f_back
        time.sleep(0.005)
    return seen


def test_a_hung_redis_blocks_neither_the_router_loop_nor_the_engine(
    cluster: Cluster, cluster_fault: Fault
):
    assert len(generate(cluster, 2)) == 4
    sampled: list[set[str]] = []
    cluster_fault.pause(3000)
    sampler = threading.Thread(target=lambda: sampled.append(redis_threads_during(2.5)))
    sampler.start()
    try:
        with cluster.client(timeout=30) as c:
            assert c.model_info().block_size > 0  # answered by the event loop
            assert c.health() == 1  # SERVING
        # Routed by load only (the index lookup times out on its own thread); the
        # engine steps while its index publisher waits on Redis.
        assert len(generate(cluster, 3)) == 4
    finally:
        sampler.join()
    (threads,) = sampled
    assert threads, "no Redis call was in flight during the pause"
    assert "router" not in threads and "engine-d0" not in threads, threads
    threads_alive(cluster)


def test_a_malformed_registry_entry_does_not_stop_the_poll_loop(
    cluster: Cluster, redis_module: RedisServer
):
    admin = redis_module.client()
    p = "ps:{registry}:"
    try:
        before = cluster.router.call(lambda r: r.counters["registry_malformed"])
        admin.set(f"{p}w:junk", b"\xff\x00junk", px=60_000)
        admin.sadd(f"{p}workers", "junk")
        wait_for(
            lambda: cluster.router.call(lambda r: r.counters["registry_malformed"]) > before + 2,
            10.0,
            "a few polls over the junk entry",
        )
        seen = fed_timestamp(cluster)
        wait_for(lambda: fed_timestamp(cluster) != seen, 10.0, "d0's stats still applied")
        assert len(generate(cluster, 4)) == 4
        threads_alive(cluster)
    finally:
        admin.delete(f"{p}w:junk")
        admin.srem(f"{p}workers", "junk")
        admin.close()


def test_clients_name_themselves_with_timeouts_set(cluster: Cluster, redis_module: RedisServer):
    admin = redis_module.client()
    try:
        names = {c["name"] for c in admin.client_list()}
        assert {"pagedserve-router-registry", "pagedserve-worker-d0"} <= names
    finally:
        admin.close()
    registry = cluster.router.call(lambda r: r.redis_registry)
    kwargs = registry._redis.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.5
    assert kwargs["health_check_interval"] > 0


# ---- the worker's index sync: a queue between the engine thread and Redis ----------------


def test_index_sync_overflow_drops_the_queue_and_resyncs(fault: Fault):
    """More events than the queue holds: dropped at once on the engine thread (which
    never waits), then a resync from a snapshot taken after the loss, as for a GAP."""
    from pagedserve.common.api.sampling_params import SamplingParams
    from pagedserve.common.core.engine import LLMEngine
    from pagedserve.common.runtime.worker import IndexSync, WorkerConfig

    cfg = tiny_engine_config()
    engine = LLMEngine(cfg)
    worker = WorkerConfig("w0", "decode", engine=cfg, redis_url=fault.server.url, index_ttl_s=5)
    sync = IndexSync(worker, engine, max_queued_events=4)
    publisher = sync.publisher
    assert publisher is not None
    index = publisher.index

    def run_engine(until: Callable[[], bool]) -> None:
        """The test thread plays the engine thread: steps, and runs the hook after each."""
        end = time.monotonic() + 30
        while not until():
            assert time.monotonic() < end, "timed out"
            if engine.has_unfinished_requests():
                engine.step()
            sync(engine)
            time.sleep(0.01)

    def indexed() -> bool:
        return index.worker_hashes("w0") == set(engine.block_manager.cached_hashes())

    try:
        run_engine(lambda: publisher.stats.resyncs == 1 and indexed())  # the first contact
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        engine.add_request("r", prompt_token_ids=list(range(3, 103)), params=params)
        run_engine(lambda: not engine.has_unfinished_requests())  # 6 full blocks: > 4 events
        run_engine(lambda: publisher.stats.resyncs == 2 and indexed())
        assert publisher.stats.dropped_events >= 6 and not publisher.degraded
        assert len(engine.block_manager.cached_hashes()) >= 6
        engine.check_integrity()
    finally:
        sync.goodbye()
    assert not sync._thread.is_alive()
