"""What every worker process runs, whatever its role: an engine on its own thread,
a gRPC server, a KV exporter, and heartbeats to the registry.

The role-specific servicers live in `prefill_worker/` and `decode_worker/`; the Ray
actors that host a runtime live there too. A runtime also runs without Ray (tests,
a single process), which is how the roles are tested one by one.

This module is an edge (gRPC), not part of the engine core.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.common.config import EngineConfig
from pagedserve.common.engine import LLMEngine
from pagedserve.common.engine_loop import EngineLoop
from pagedserve.common.grpc_options import CHANNEL_OPTIONS, SERVER_OPTIONS
from pagedserve.common.loader import LoadedModel
from pagedserve.common.prefix_index import IndexPublisher, open_prefix_index
from pagedserve.common.prefix_index.remote import RemotePrefixIndex
from pagedserve.kvtransfer.handle import local_host_id
from pagedserve.kvtransfer.source import KVSource, add_kvtransfer_service
from pagedserve.kvtransfer.transport import AutoTransport
from pagedserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

Pool = Literal["prefill", "decode", "colocated"]
POOL_TO_PB = {
    "prefill": worker_pb2.WORKER_POOL_PREFILL,
    "decode": worker_pb2.WORKER_POOL_DECODE,
    "colocated": worker_pb2.WORKER_POOL_COLOCATED,
}
# Shared with the router and the client (keepalive must agree on both ends).
GRPC_OPTIONS = CHANNEL_OPTIONS


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    pool: Pool
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"  # where the gRPC server listens
    port: int = 0  # 0 = any free port
    advertise_host: str | None = None  # the address others dial; None = `host`
    registry_address: str | None = None  # the router's Registry service (host:port)
    heartbeat_interval_s: float = 1.0
    lease_ttl_s: float = 30.0  # exported KV not pulled within this is freed and counted
    kv_transport: Literal["auto", "shm", "grpc"] = "auto"
    transfer_failure_policy: Literal["recompute", "fail"] = "recompute"
    max_rpc_threads: int = 128  # each open Decode stream holds one
    # Where this worker publishes its prefix-cache events: a Redis URL (the shared
    # index), else the router's PrefixIndex service at `index_address` (embedded),
    # else nowhere (a worker on its own).
    redis_url: str | None = None
    index_address: str | None = None
    index_ttl_s: float = 10.0  # a worker silent this long drops out of the index
    # Prometheus endpoint (common/metrics.py) on `host`: None = none, 0 = any free port.
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if self.pool not in POOL_TO_PB:
            raise ValueError(f"pool must be one of {sorted(POOL_TO_PB)}, got {self.pool!r}")
        if self.heartbeat_interval_s <= 0 or self.lease_ttl_s <= 0:
            raise ValueError("heartbeat_interval_s and lease_ttl_s must be > 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535] or None: {self.metrics_port}")


class WorkerRuntime:
    """Engine + gRPC server + KV exporter + registry heartbeats of one worker."""

    def __init__(self, config: WorkerConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.engine = LLMEngine(config.engine, loaded)
        self.loop = EngineLoop(self.engine, name=f"engine-{config.worker_id}")
        # One thread per open call, at most max_rpc_threads; calls beyond that are
        # answered RESOURCE_EXHAUSTED by gRPC at once instead of queueing without
        # bound (the router places them on another worker).
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_rpc_threads),
            options=SERVER_OPTIONS,
            maximum_concurrent_rpcs=config.max_rpc_threads,
        )
        self.port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        self.address = f"{config.advertise_host or config.host}:{self.port}"
        self.host_id = local_host_id()
        self.kv_source = KVSource(
            host_id=self.host_id,
            transfer_address=self.address,
            use_shm=config.kv_transport != "grpc",
            default_ttl_s=config.lease_ttl_s,
            on_expire=self._on_lease_expired,
        )
        add_kvtransfer_service(self.server, self.kv_source)
        self.kv_transport = AutoTransport(host_id=self.host_id, mode=config.kv_transport)
        worker_pb2_grpc.add_WorkerStatusServicer_to_server(_StatusServicer(self), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.loop.step_hooks.append(lambda _engine: self.kv_source.expire())
        self.index_sync = IndexSync(config, self.engine)
        self.loop.step_hooks.append(self.index_sync)
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        # -- Redis worker registry (issue 6): stats also go to Redis when redis_url is set,
        # so that every router replica sees this worker (router/server.py reads them).
        self.registry_publisher = None
        if config.redis_url:
            from pagedserve.common.prefix_index.worker_registry import RegistryPublisher

            self.registry_publisher = RegistryPublisher(
                config.redis_url, config.worker_id, ttl_s=config.index_ttl_s
            )
        # -- Prometheus metrics (common/metrics.py): served by start() when metrics_port is set.
        self.metrics = None
        if config.metrics_port is not None:
            from pagedserve.common.metrics import WorkerMetrics

            self.metrics = WorkerMetrics.attach(self)

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> WorkerRuntime:
        self.loop.start()
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        if self.metrics is not None:
            self.metrics.serve(self.config.host, self.config.metrics_port)
        if self.config.registry_address or self.registry_publisher is not None:
            self._heartbeat_thread = threading.Thread(
                target=self._heartbeat_loop, name="heartbeat", daemon=True
            )
            self._heartbeat_thread.start()
        logger.info(
            "worker %s (%s) serving on %s", self.config.worker_id, self.config.pool, self.address
        )
        return self

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self.health.enter_graceful_shutdown()
        if self.config.registry_address:
            try:
                with grpc.insecure_channel(self.config.registry_address) as ch:
                    worker_pb2_grpc.RegistryStub(ch).Goodbye(
                        worker_pb2.GoodbyeRequest(worker_id=self.config.worker_id), timeout=1.0
                    )
            except grpc.RpcError:
                pass  # the router is gone too; its heartbeat timeout drops us
        if self.registry_publisher is not None:
            self.registry_publisher.goodbye()
        self.server.stop(grace).wait()
        if self.metrics is not None:
            self.metrics.close()
        self.loop.stop()
        self.index_sync.goodbye()
        self.kv_source.close()

    # -- status -------------------------------------------------------------------

    def _on_lease_expired(self, lease_id: str) -> None:
        logger.warning("lease %s expired unpulled; its KV was freed", lease_id)

    def stats(self) -> worker_pb2.WorkerStats:
        # Read from this thread, not through the engine loop: a heartbeat must not wait
        # behind a long prefill step (the router would drop a busy worker). Every field
        # is an int or a len() read, atomic under the GIL; a snapshot may mix values
        # from two consecutive steps, which load reporting tolerates.
        s = self.engine.stats()
        bm = self.engine.block_manager.stats()
        return worker_pb2.WorkerStats(
            worker_id=self.config.worker_id,
            pool=POOL_TO_PB[self.config.pool],
            address=self.address,
            host_id=self.host_id,
            # Always the engine's model id: the router hashes prompts and namespaces the
            # prefix index with it, so it must be exactly what the block manager uses.
            model_name=self.engine.model_id,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            num_free_blocks=s.num_free_blocks,
            num_cached_blocks=bm.num_cached_free,
            num_total_blocks=s.num_blocks,
            open_leases=self.kv_source.open_leases,
            expired_leases_total=self.kv_source.expired_total,
            timestamp_unix_ms=int(time.time() * 1000),
            block_size=self.engine.block_manager.block_size,
            num_preemptions=s.num_preemptions,
            prefix_query_tokens=s.prefix_query_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
        )

    def check_integrity(self) -> None:
        self.loop.call(lambda e: e.check_integrity())

    def _heartbeat_loop(self) -> None:
        address = self.config.registry_address
        channel = grpc.insecure_channel(address) if address else None
        stub = worker_pb2_grpc.RegistryStub(channel) if channel else None
        while not self._stop.is_set():
            stats = None
            try:
                stats = self.stats()
                if stub is not None:
                    stub.Heartbeat(worker_pb2.HeartbeatRequest(stats=stats), timeout=2.0)
            except grpc.RpcError as e:
                logger.debug("heartbeat to %s failed: %s", address, e)
            except Exception:
                logger.exception("heartbeat failed")
            if stats is not None and self.registry_publisher is not None:
                self.registry_publisher.beat(stats.SerializeToString())  # logs an outage once
            self._stop.wait(self.config.heartbeat_interval_s)
        if channel is not None:
            channel.close()


class _StatusServicer(worker_pb2_grpc.WorkerStatusServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    def GetStats(self, request, context):  # noqa: N802 (gRPC method name)
        return self.runtime.stats()


class IndexSync:
    """Publishes the block manager's events to the prefix index; a step hook.

    Runs on the engine thread (the block manager's owner), after every step and
    every idle tick. Events are drained even with no index configured, so they never
    pile up. When the index is unreachable the publisher drops its buffer (a resync
    will follow) and this hook waits `retry_s` before trying again, so an outage
    costs the engine one failed call per `retry_s`, not one per step.
    """

    def __init__(self, config: WorkerConfig, engine: LLMEngine, retry_s: float = 1.0) -> None:
        self.engine = engine
        self.retry_s = retry_s
        self._retry_at = 0.0
        self.publisher: IndexPublisher | None = None
        index = None
        if config.redis_url:
            index = open_prefix_index(config.redis_url, engine.model_id)
        elif config.index_address:
            index = RemotePrefixIndex(config.index_address, timeout_s=0.5)
        if index is not None:
            self.publisher = IndexPublisher(
                index,
                config.worker_id,
                snapshot=engine.block_manager.cached_hashes,
                ttl_s=config.index_ttl_s,
            )

    def __call__(self, engine: LLMEngine) -> None:
        events = engine.block_manager.drain_events()
        if self.publisher is None:
            return
        self.publisher.add(events)
        now = time.monotonic()
        if now < self._retry_at:
            return
        if not self.publisher.tick():
            self._retry_at = now + self.retry_s

    def goodbye(self) -> None:
        if self.publisher is not None:
            self.publisher.goodbye()
            self.publisher.index.close()
