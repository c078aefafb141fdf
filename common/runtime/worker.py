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
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.common.core.config import EngineConfig
from pagedserve.common.core.engine import LLMEngine
from pagedserve.common.core.engine_loop import EngineLoop
from pagedserve.common.core.kv_cache import remove_stale_cache_files
from pagedserve.common.core.loader import LoadedModel
from pagedserve.common.runtime.grpc_options import (
    CHANNEL_OPTIONS,
    HEARTBEAT_CHANNEL_OPTIONS,
    SERVER_OPTIONS,
)
from pagedserve.common.runtime.leases import LeaseReleaser
from pagedserve.common.runtime.peers import TrustedPeers
from pagedserve.common.runtime.prefix_index import IndexPublisher, open_prefix_index
from pagedserve.common.runtime.prefix_index.faults import Backoff, LogLimiter
from pagedserve.common.runtime.prefix_index.remote import RemotePrefixIndex
from pagedserve.common.runtime.tls import (
    TLSFiles,
    add_port,
    channel,
    internal_channel_credentials,
    internal_server_credentials,
)
from pagedserve.kvtransfer import faults
from pagedserve.kvtransfer.handle import KVLayout, local_host_id
from pagedserve.kvtransfer.segment import SHM_DIR, free_bytes, remove_stale_segments
from pagedserve.kvtransfer.source import KVSource, add_kvtransfer_service
from pagedserve.kvtransfer.transport import (
    AutoTransport,
    ChannelCache,
    GrpcTransport,
    ShmTransport,
)
from pagedserve.kvtransfer.validate import ImportLimits
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
    # The router's internal listener (its Registry; router.internal_address), host:port.
    registry_address: str | None = None
    heartbeat_interval_s: float = 1.0
    lease_ttl_s: float = 30.0  # exported KV not pulled within this is freed and counted
    kv_transport: Literal["auto", "shm", "grpc"] = "auto"
    transfer_failure_policy: Literal["recompute", "fail"] = "recompute"
    max_rpc_threads: int = 128  # each open Decode stream holds one
    # Where this worker publishes its prefix-cache events: a Redis URL (the shared
    # index), else the router's PrefixIndex service at `index_address` (embedded),
    # else nowhere (a worker on its own).
    redis_url: str | None = field(default=None, repr=False)  # may carry a password
    index_address: str | None = None
    index_ttl_s: float = 10.0  # a worker silent this long drops out of the index
    # Prometheus endpoint (common/runtime/metrics.py) on `host`: None = none, 0 = any free port.
    metrics_port: int | None = None
    # "vllm": also export the vLLM-named series (vllm:num_requests_waiting, ...) that the
    # inference gateway and vLLM's dashboards read; None: pagedserve:* only.
    metrics_compat: Literal["vllm"] | None = None
    # Bounds on waiting (races and leaks, see EngineLoop.call and kvtransfer/transport.py):
    engine_call_timeout_s: float = 30.0  # a handler waiting on the engine loop gives up
    kv_pull_timeout_s: float = 60.0  # deadline of every KV pull (PullBlocks, prefix import)
    release_lease_timeout_s: float = 5.0  # deadline of ReleaseLease to an exporter
    max_peer_channels: int = 32  # open channels to other workers (LRU), per client
    # KV staging (kvtransfer/source.py). Staged bytes are capped at kv_max_staged_bytes,
    # None = half the free space of kv_shm_dir when the worker starts (other workers on
    # the host share it); an export past a cap fails with RESOURCE_EXHAUSTED. Pullers
    # must use the same kv_shm_dir (it is configurable for tests on a small tmpfs).
    kv_shm_dir: str = str(SHM_DIR)
    kv_max_staged_bytes: int | None = None
    kv_max_open_leases: int = 1024
    # In-place exports (kvtransfer/source.py): when the engine's KV cache is in shared
    # memory (engine.cache.shm_dir, which must then be kv_shm_dir: pullers look for the
    # cache file there), exports are read in place and their blocks stay pinned until
    # the lease ends, at most this many bytes of blocks at once (past it: staged). None
    # = half of this worker's KV cache: a cap that scales with the pool (a fixed 256 MiB
    # was a quarter of the default 1 GiB cache and under 1 % of a 40 GiB one), and
    # leaves the other half to new prefills and the prefix cache while slow decode
    # workers hold leases (past it exports are staged copies, which pin nothing).
    kv_max_in_place_bytes: int | None = None
    # In-place exports by default: the engine's KV cache goes in a shared-memory file in
    # kv_shm_dir (CacheConfig.shm_dir), so that same-host pullers copy exported blocks
    # straight out of it: one copy instead of two (57-64 % of a memcpy against 16-21 %
    # staged, 2-core Skylake-SP Xeon, benchmarks/NOTES.md). Attention on the tmpfs-backed
    # cache measured no slower there. Not where no same-host puller can read it
    # (kv_transport "grpc"), for a GPU cache, or with kv_in_place=False; an engine
    # config that names its own shm_dir keeps it. A directory without room for the
    # cache falls back to ordinary memory and staged exports, with a warning.
    kv_in_place: bool = True
    # Addresses ("host:port") whose KV handles this worker pulls from besides its own,
    # the registry's live workers of its model and this process's runtimes
    # (common/runtime/peers.py): for a worker without a registry.
    trusted_peers: tuple[str, ...] = ()
    # Mutual TLS on the internal plane (common/runtime/tls.py): this worker's server,
    # its heartbeats and index publishing to the router, and its KV pulls and lease
    # releases to other workers. The certificate must name `advertise_host` (or `host`),
    # the name the router and the other workers dial. None = plaintext.
    internal_tls: TLSFiles | None = None

    def in_place_cap_bytes(self, cache_bytes: int) -> int:
        """kv_max_in_place_bytes, or half of a KV cache of `cache_bytes`."""
        if self.kv_max_in_place_bytes is not None:
            return self.kv_max_in_place_bytes
        return cache_bytes // 2

    def engine_config(self) -> EngineConfig:
        """The engine config this worker runs: `engine`, with the KV cache in kv_shm_dir
        when in-place exports apply (see kv_in_place)."""
        cache = self.engine.cache
        if (
            not self.kv_in_place
            or self.kv_transport == "grpc"
            or cache.shm_dir is not None
            or not self.engine.device.startswith("cpu")
        ):
            return self.engine
        return replace(self.engine, cache=replace(cache, shm_dir=self.kv_shm_dir))

    def __post_init__(self) -> None:
        if self.pool not in POOL_TO_PB:
            raise ValueError(f"pool must be one of {sorted(POOL_TO_PB)}, got {self.pool!r}")
        if self.heartbeat_interval_s <= 0 or self.lease_ttl_s <= 0:
            raise ValueError("heartbeat_interval_s and lease_ttl_s must be > 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535] or None: {self.metrics_port}")
        if self.metrics_compat not in (None, "vllm"):
            raise ValueError(f"metrics_compat must be 'vllm' or None, got {self.metrics_compat!r}")
        for name in ("engine_call_timeout_s", "kv_pull_timeout_s", "release_lease_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_max_in_place_bytes is not None and self.kv_max_in_place_bytes < 0:
            raise ValueError(f"kv_max_in_place_bytes must be >= 0: {self.kv_max_in_place_bytes}")
        if self.max_peer_channels < 1 or self.kv_max_open_leases < 1:
            raise ValueError("max_peer_channels and kv_max_open_leases must be >= 1")
        if self.internal_tls is not None:
            self.internal_tls.require_ca("WorkerConfig.internal_tls (mutual TLS)")
        if self.kv_max_staged_bytes is not None and self.kv_max_staged_bytes < 1:
            raise ValueError(
                f"kv_max_staged_bytes must be >= 1 or None: {self.kv_max_staged_bytes}"
            )

    def staging_cap_bytes(self) -> int:
        """kv_max_staged_bytes, or half of kv_shm_dir's free space now (at least 64 MiB)."""
        if self.kv_max_staged_bytes is not None:
            return self.kv_max_staged_bytes
        try:
            free = free_bytes(Path(self.kv_shm_dir))
        except OSError:
            free = 0
        return max(free // 2, 64 << 20)


class WorkerRuntime:
    """Engine + gRPC server + KV exporter + registry heartbeats of one worker."""

    def __init__(self, config: WorkerConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        engine_config = config.engine_config()
        if engine_config.cache.shm_dir is not None:  # room for this worker's cache first
            _remove_stale(remove_stale_cache_files, Path(engine_config.cache.shm_dir))
        self.engine = LLMEngine(engine_config, loaded)
        self.loop = EngineLoop(self.engine, name=f"engine-{config.worker_id}")
        # A no-op unless a test installed a fault injector (kvtransfer/faults.py).
        self.loop.step_gate = lambda: faults.fault_step(config.worker_id, self.address)
        # One thread per open call, at most max_rpc_threads; calls beyond that are
        # answered RESOURCE_EXHAUSTED by gRPC at once instead of queueing without
        # bound (the router places them on another worker).
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_rpc_threads),
            options=SERVER_OPTIONS,
            maximum_concurrent_rpcs=config.max_rpc_threads,
        )
        tls = config.internal_tls
        # Mutual TLS both ways on the internal plane: who calls this server, and whom it calls.
        self.channel_credentials = internal_channel_credentials(tls) if tls else None
        server_credentials = internal_server_credentials(tls) if tls else None
        self.port = add_port(self.server, f"{config.host}:{config.port}", server_credentials)
        if self.port == 0:
            raise OSError(f"worker {config.worker_id} cannot listen on {config.host}:{config.port}")
        self.address = f"{config.advertise_host or config.host}:{self.port}"
        self.host_id = local_host_id()
        # Where KV handles may be pulled from (peers.py); refreshed by the heartbeats.
        self.peers = TrustedPeers(
            self.address,
            self.engine.model_id,
            config.trusted_peers,
            has_registry=config.registry_address is not None,
        )
        # What a KV handle must match to be imported here (kvtransfer/validate.py).
        self.import_limits = ImportLimits(
            KVLayout.of_cache(self.engine.kv_cache.kv),
            self.engine.spec.vocab_size,
            self.engine.model_id,
        )
        shm_dir = Path(config.kv_shm_dir)
        if config.kv_transport != "grpc":
            _remove_stale(remove_stale_segments, shm_dir)
        self.kv_source = KVSource(
            host_id=self.host_id,
            transfer_address=self.address,
            use_shm=config.kv_transport != "grpc",
            shm_dir=shm_dir,
            default_ttl_s=config.lease_ttl_s,
            on_expire=self._on_lease_expired,
            max_staged_bytes=config.staging_cap_bytes(),
            max_open_leases=config.kv_max_open_leases,
            max_in_place_bytes=config.in_place_cap_bytes(self.engine.kv_cache.nbytes),
        )
        add_kvtransfer_service(self.server, self.kv_source)
        self.kv_transport = AutoTransport(
            host_id=self.host_id,
            mode=config.kv_transport,
            shm=ShmTransport(shm_dir),
            grpc_transport=GrpcTransport(
                timeout_s=config.kv_pull_timeout_s,
                max_channels=config.max_peer_channels,
                credentials=self.channel_credentials,
            ),
        )
        self.lease_releaser = LeaseReleaser(
            ChannelCache(config.max_peer_channels, credentials=self.channel_credentials),
            timeout_s=config.release_lease_timeout_s,
        )
        worker_pb2_grpc.add_WorkerStatusServicer_to_server(_StatusServicer(self), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.loop.step_hooks.append(lambda _engine: self.kv_source.expire())
        self.index_sync = IndexSync(config, self.engine, self.channel_credentials)
        self.loop.step_hooks.append(self.index_sync)
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self.draining = False  # set by drain(): reported in every heartbeat from then on
        # -- Redis worker registry (issue 6): stats also go to Redis when redis_url is set,
        # so that every router replica sees this worker (router/server.py reads them).
        self.registry_publisher = None
        if config.redis_url:
            from pagedserve.common.runtime.prefix_index.worker_registry import RegistryPublisher

            self.registry_publisher = RegistryPublisher(
                config.redis_url, config.worker_id, ttl_s=config.index_ttl_s
            )
        # -- Prometheus metrics (common/runtime/metrics.py): served by start() when metrics_port is set.
        self.metrics = None
        if config.metrics_port is not None:
            from pagedserve.common.runtime.metrics import WorkerMetrics

            self.metrics = WorkerMetrics.attach(self)

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> WorkerRuntime:
        self.loop.start()
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.peers.serving()
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

    def drain(self, timeout_s: float) -> bool:
        """Empties this worker before it leaves (a scale-down); True when it emptied in time.

        From now on its heartbeats say `draining`: the router sends it no new request and
        pulls no prefix from it, while it finishes what it holds. It is empty once no
        request runs or waits and no lease is open (its exported KV was pulled). Requests
        routed just before the router saw the flag may still arrive, so it is not called
        empty before two heartbeat intervals have passed. Stopping is the caller's
        (stop(): Goodbye, then the server ends).
        """
        self.draining = True
        t0 = time.monotonic()
        settle = 2 * self.config.heartbeat_interval_s
        while True:
            now = time.monotonic()
            if now - t0 >= settle and self._empty():
                return True
            if now - t0 >= timeout_s:
                logger.warning(
                    "worker %s still holds requests after %g s of draining: stopping anyway",
                    self.config.worker_id,
                    timeout_s,
                )
                return False
            time.sleep(0.05)

    def _empty(self) -> bool:
        s = self.engine.stats()
        return s.num_running == 0 and s.num_waiting == 0 and self.kv_source.open_leases == 0

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self.peers.stopped()
        self.health.enter_graceful_shutdown()
        if self.config.registry_address:
            try:
                address = self.config.registry_address
                with channel(address, self.channel_credentials) as ch:
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
        self.kv_source.close()  # ends in-place leases: their unpins are moot now
        self.kv_transport.close()
        self.lease_releaser.close()
        self.engine.kv_cache.close()  # unlinks a shared cache file (pullers keep mappings)

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
            draining=self.draining,
        )

    def check_integrity(self) -> None:
        self.loop.call(lambda e: e.check_integrity())

    def _heartbeat_loop(self) -> None:
        """Beats every `heartbeat_interval_s` (from the end of the last beat) until stop.

        Nothing may end this thread but stop(): a worker whose heartbeats stop leaves
        routing for good. Every failure is logged (rate-limited) and the next beat
        tries again; the Redis publisher backs off by itself and never raises.
        """
        address = self.config.registry_address
        ch = (
            channel(address, self.channel_credentials, HEARTBEAT_CHANNEL_OPTIONS)
            if address
            else None
        )
        stub = worker_pb2_grpc.RegistryStub(ch) if ch else None
        log = LogLimiter(logger)
        while not self._stop.is_set():
            try:
                self._beat_once(stub)
            except grpc.RpcError as e:
                log.log(logging.DEBUG, "rpc", "heartbeat to %s failed: %s", address, e)
            except Exception:
                log.log(logging.ERROR, "bug", "heartbeat failed", exc_info=True)
            # The interval, or sooner when a KV handle names an unknown peer (peers.py).
            self.peers.wait_next_beat(self.config.heartbeat_interval_s, self._stop)
        if ch is not None:
            ch.close()

    def _beat_once(self, stub: worker_pb2_grpc.RegistryStub | None) -> None:
        stats = self.stats()
        self.peers.beat_started()
        try:
            if stub is not None:
                answer = stub.Heartbeat(worker_pb2.HeartbeatRequest(stats=stats), timeout=2.0)
                self.peers.set_live(p.transfer_address for p in answer.peers)
        finally:  # the Redis registry gets its beat even when the router's failed
            self.peers.beat_finished()
            if self.registry_publisher is not None:
                self.registry_publisher.beat(stats.SerializeToString())  # never raises


def _remove_stale(remove: Callable[[Path], list[str]], shm_dir: Path) -> None:
    """Files left in shm_dir by workers that died (their pid is gone): KV segments and
    in-place descriptors, or KV cache files; `remove` unlinks them.

    At start-up, so a crash loop (Ray restarting a worker) cannot fill /dev/shm.
    """
    try:
        removed = remove(shm_dir)
    except OSError as e:
        logger.warning("could not clean stale KV files in %s: %s", shm_dir, e)
        return
    if removed:
        logger.info("removed %d stale KV files from %s", len(removed), shm_dir)


class _StatusServicer(worker_pb2_grpc.WorkerStatusServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    def GetStats(self, request, context):  # noqa: N802 (gRPC method name)
        return self.runtime.stats()


class IndexSync:
    """Publishes the block manager's events to the prefix index without stalling the engine.

    Two halves:

    - the step hook (``__call__``), on the engine thread after every step and idle
      tick: drains the block manager's events into a bounded queue and answers
      snapshot requests. Memory work only: it never waits on the index, so a Redis
      that hangs (``CLIENT PAUSE``, a dead link) does not slow ``engine.step()``.
      Events are drained even with no index configured, so they never pile up.
    - a publishing thread (``index-sync-<worker>``, started by the first hook call):
      numbers the queued events (``IndexPublisher.add``), flushes them, heartbeats and
      resyncs; after a failed call it backs off (``retry_s`` doubling up to
      ``max_retry_s``, jittered, measured from the end of the failed call).

    Decisions
    ---------
    - The queue holds at most ``max_queued_events``. When an event would not fit, the
      queue is emptied and the loss reported (``IndexPublisher.lost``): the next flush
      resyncs, from a snapshot taken after the loss. Only events queued after the
      loss are replayed on top of it, never an older one that a dropped newer event
      would have contradicted (the snapshot-plus-replay argument of base.py).
    - The snapshot is taken on the engine thread (the block manager is not
      thread-safe): the publishing thread asks, the hook answers at its next run
      (after the current step, or within the engine loop's 50 ms idle tick), after
      draining, so every event numbered before it is covered.
    - Liveness follows the engine: the publishing thread heartbeats and flushes only
      while the hook ran within ``ttl/2``, so a stopped or wedged engine loop leaves the
      index within its TTL, as when heartbeats ran on the engine thread.
    """

    POLL_S = 0.1  # the publishing thread's wake-up when nothing arrives (heartbeats)

    def __init__(
        self,
        config: WorkerConfig,
        engine: LLMEngine,
        credentials: grpc.ChannelCredentials | None = None,
        retry_s: float = 0.25,
        max_retry_s: float = 5.0,
        max_queued_events: int = 1 << 16,
        snapshot_timeout_s: float = 10.0,
    ) -> None:
        self.engine = engine
        self.worker_id = config.worker_id
        self.backoff = Backoff(retry_s, max_retry_s)
        self.max_queued_events = max_queued_events
        self.snapshot_timeout_s = snapshot_timeout_s
        self.stall_s = config.index_ttl_s / 2
        self.publisher: IndexPublisher | None = None
        self._cond = threading.Condition()
        self._queue: list[list[object]] = []  # drained event lists, oldest first
        self._queued = 0  # events in _queue
        self._lost = 0  # events dropped on overflow, not yet reported to the publisher
        self._snapshot_wanted = False
        self._snapshot: list[bytes] | None = None
        self._last_hook = float("-inf")  # monotonic time of the hook's last run
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = LogLimiter(logger)
        index = None
        if config.redis_url:
            from pagedserve.common.runtime.prefix_index.connection import client_name

            index = open_prefix_index(
                config.redis_url, engine.model_id, name=client_name("worker", config.worker_id)
            )
        elif config.index_address:
            index = RemotePrefixIndex(config.index_address, timeout_s=0.5, credentials=credentials)
        if index is not None:
            self.publisher = IndexPublisher(
                index,
                config.worker_id,
                snapshot=self._take_snapshot,
                ttl_s=config.index_ttl_s,
            )

    # -- the engine thread -------------------------------------------------------------

    def __call__(self, engine: LLMEngine) -> None:
        events = engine.block_manager.drain_events()
        if self.publisher is None:
            return
        with self._cond:
            self._last_hook = time.monotonic()
            if events:
                if self._queued + len(events) > self.max_queued_events:
                    self._lost += self._queued + len(events)
                    self._queue.clear()
                    self._queued = 0
                else:
                    self._queue.append(events)
                    self._queued += len(events)
                self._cond.notify_all()
            wanted = self._snapshot_wanted
        if wanted:  # after draining: the snapshot covers every event queued so far
            hashes = engine.block_manager.cached_hashes()
            with self._cond:
                self._snapshot, self._snapshot_wanted = hashes, False
                self._cond.notify_all()
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(
                target=self._run, name=f"index-sync-{self.worker_id}", daemon=True
            )
            self._thread.start()

    # -- the publishing thread ---------------------------------------------------------

    def _take_snapshot(self) -> list[bytes]:
        """The block manager's cached hashes, taken by the engine thread (see Decisions)."""
        deadline = time.monotonic() + self.snapshot_timeout_s
        with self._cond:
            self._snapshot, self._snapshot_wanted = None, True
            while self._snapshot is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    self._snapshot_wanted = False
                    raise TimeoutError(
                        f"engine thread gave no block-hash snapshot within "
                        f"{self.snapshot_timeout_s:g} s (stopped or stuck in a step)"
                    )
                self._cond.wait(min(left, self.POLL_S))
            hashes, self._snapshot = self._snapshot, None
            return hashes

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                wait_s = self.backoff.delay() or self.POLL_S
                self._cond.wait_for(
                    lambda: self._queue or self._lost or self._stop.is_set(), wait_s
                )
                batches, self._queue, self._queued = self._queue, [], 0
                lost, self._lost = self._lost, 0
                engine_alive = time.monotonic() - self._last_hook <= self.stall_s
            try:
                self._publish(batches, lost, engine_alive)
            except Exception:  # a bug: logged, and the loop goes on
                self.backoff.failed()
                self._log.log(logging.ERROR, "bug", "index sync failed", exc_info=True)

    def _publish(self, batches: list[list[object]], lost: int, engine_alive: bool) -> None:
        publisher = self.publisher
        assert publisher is not None
        if lost:
            self._log.log(
                logging.WARNING,
                "overflow",
                "index sync of %s: queue full, %d events dropped; resyncing",
                self.worker_id,
                lost,
            )
            publisher.lost(lost)
        for events in batches:
            try:
                publisher.add(events)
            except Exception:  # not a block event: count it lost, so numbering stays true
                publisher.lost(len(events))
                self._log.log(logging.ERROR, "add", "unpublishable events", exc_info=True)
        if self._stop.is_set() or not engine_alive or not self.backoff.ready():
            return
        if publisher.tick():
            self.backoff.succeeded()
        else:
            self.backoff.failed()  # now, after the call returned: from its end

    def goodbye(self) -> None:
        """Stops the publishing thread and removes this worker from the index."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.publisher is not None:
            self.publisher.goodbye()
            self.publisher.index.close()
