"""A router plus in-process workers on a tiny checkpoint, over real gRPC on loopback.

`start_cluster` starts the router (its own thread and event loop), then workers that
register with it by heartbeat, and returns once every worker is routable. Each worker
has its own engine, KV pool, gRPC server and KV exporter, and its own copy of the tiny
model: a LoadedModel must not be shared between workers, because the attention
backend keeps per-step plans and scratch buffers (engines step on separate threads).
`Cluster.stop()` stops everything it started.

The `cluster` fixture (module scope) is 2 prefill + 2 decode workers; import it into
a test module with `from router_fixtures import cluster`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import pytest
from builders import tiny_checkpoint

from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.common.runtime.worker import WorkerConfig, WorkerRuntime
from pagedserve.kvtransfer import faults
from pagedserve.kvtransfer.faults import ENGINE_STEP, FaultInjector, Gate
from pagedserve.router.client import Client
from pagedserve.router.config import RouterConfig
from pagedserve.router.server import RouterHandle, start_router_in_thread
from pagedserve.worker import start_worker

MAX_MODEL_LEN = 256
HEARTBEAT_S = 0.2


def tiny_engine_config(arch: str = "llama", num_blocks: int = 128) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_checkpoint(arch)),
        dtype="float32",
        cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN),
        num_threads=1,
    )


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Polls `cond` every 20 ms; fails the test naming `what` after `timeout` s."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@dataclass
class HeldEngines:
    """The gates of `engine_held`, one per worker."""

    gates: dict[str, Gate]
    injector: FaultInjector

    def wait(self, timeout: float = 10.0) -> str:
        """Until one of the engines is held; returns its worker id. The other workers'
        gates are withdrawn then: only that engine stays held."""
        wait_for(lambda: self.held() is not None, timeout, "an engine to be held")
        wid = self.held()
        assert wid is not None
        for other, gate in self.gates.items():
            if other != wid:
                self.injector.withdraw(gate)
        return wid

    def held(self) -> str | None:
        return next((w for w, g in self.gates.items() if g.reached.is_set()), None)

    def release(self) -> None:
        for gate in self.gates.values():
            self.injector.withdraw(gate)


@contextlib.contextmanager
def engine_held(workers: Iterable[WorkerRuntime], after_steps: int = 1) -> Iterator[HeldEngines]:
    """Holds each of these workers' engines once it ran `after_steps` steps (with requests).

    A held engine steps nothing until the block exits, but its loop still runs
    commands (reads, aborts, new requests): a request in flight there stays in flight,
    its first tokens streamed, whatever the machine's speed (kvtransfer/faults.py
    ENGINE_STEP). Tests that need a request still running at some point hold it this
    way, never by betting on a time. Uses the installed fault injector (the slow
    mode's, README "Development") or installs one for the block.
    """
    with _injector() as injector:
        held = HeldEngines(
            {
                w.config.worker_id: injector.pause(
                    ENGINE_STEP, only=w.config.worker_id, skip=after_steps - 1
                )
                for w in workers
            },
            injector,
        )
        try:
            yield held
        finally:
            held.release()


@contextlib.contextmanager
def decode_stream_held(worker: WorkerRuntime | None = None) -> Iterator[Gate]:
    """Holds the next Decode stream that reaches its first message (on `worker`, or on
    any): the router sees that request in flight until the block exits, whatever the
    machine's speed, while every other request runs on (kvtransfer/faults.py, point
    "Decode.step"). Its engine may finish it meanwhile: for a request held *in the
    engine*, use engine_held. `gate.wait()` returns once it is held."""
    with _injector() as injector:
        gate = injector.pause("Decode.step", only=worker.config.worker_id if worker else None)
        try:
            yield gate
        finally:
            injector.withdraw(gate)


@contextlib.contextmanager
def _injector() -> Iterator[FaultInjector]:
    """The installed fault injector (the slow mode's), or one installed for the block."""
    injector = faults.active()
    if injector is not None:
        yield injector
        return
    injector = FaultInjector()
    faults.install(injector)
    try:
        yield injector
    finally:
        if faults.active() is injector:
            faults.install(None)


@dataclass
class Cluster:
    router: RouterHandle
    engine_config: EngineConfig
    workers: dict[str, WorkerRuntime] = field(default_factory=dict)
    heartbeat_interval_s: float = HEARTBEAT_S

    @property
    def address(self) -> str:
        return self.router.address

    # The router's internal listener: what workers register and publish at.
    internal_address = property(lambda self: self.router.internal_address)

    def client(self, timeout: float | None = 60.0) -> Client:
        return Client(self.address, timeout=timeout)

    def pool(self, pool: str) -> list[WorkerRuntime]:
        return [w for w in self.workers.values() if w.config.pool == pool]

    def add_worker(self, worker_id: str, pool: str, **overrides: object) -> WorkerRuntime:
        """Starts a worker and waits until the router routes to it."""
        cfg = WorkerConfig(
            worker_id=worker_id,
            pool=pool,  # type: ignore[arg-type]
            engine=self.engine_config,
            registry_address=self.internal_address,
            heartbeat_interval_s=self.heartbeat_interval_s,
        )
        rt = start_worker(dataclasses.replace(cfg, **overrides))
        self.workers[worker_id] = rt
        wait_for(lambda: self.registered(worker_id), what=f"{worker_id} to register")
        return rt

    def registered(self, worker_id: str) -> bool:
        return self.router.call(lambda r: r.registry.get(worker_id) is not None)

    def crash(self, worker_id: str) -> WorkerRuntime:
        """Stops a worker the way a crash does: no Goodbye, heartbeats just stop."""
        rt = self.workers.pop(worker_id)
        rt._stop.set()  # ends the heartbeat loop without the Goodbye that stop() sends
        rt.server.stop(0).wait()
        rt.loop.stop()
        rt.kv_source.close()
        return rt

    def remove(self, worker_id: str) -> None:
        """A clean stop (Goodbye included)."""
        self.workers.pop(worker_id).stop(grace=0.5)

    def quiescent(self) -> bool:
        """Every worker's pool is free-or-cached and no lease is open."""
        return all(
            w.loop.call(lambda e: e.block_manager.usage()) == 0 and w.kv_source.open_leases == 0
            for w in self.workers.values()
        )

    def wait_quiescent(self, timeout: float = 10.0) -> None:
        wait_for(self.quiescent, timeout, "every worker's blocks and leases to return")
        for w in self.workers.values():
            w.check_integrity()

    def stop(self) -> None:
        for wid in list(self.workers):
            self.remove(wid)
        self.router.stop()


def start_cluster(
    router_config: RouterConfig,
    pools: dict[str, int],
    engine_config: EngineConfig | None = None,
) -> Cluster:
    """A router + workers, e.g. pools={"prefill": 2, "decode": 2} -> p0, p1, d0, d1."""
    engine_config = engine_config or tiny_engine_config()
    router_config = dataclasses.replace(router_config, model=engine_config.model)
    cluster = Cluster(start_router_in_thread(router_config), engine_config)
    try:
        for pool, count in pools.items():
            for i in range(count):
                cluster.add_worker(f"{pool[0]}{i}", pool)
    except BaseException:
        cluster.stop()
        raise
    return cluster


ROUTER_CONFIG = RouterConfig(
    port=0,
    max_model_len=MAX_MODEL_LEN,
    max_inflight=64,
    max_queued=64,
    worker_timeout_s=30.0,  # tests drop workers explicitly, never by a slow heartbeat
    disagg_min_prompt_tokens=8,
)


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(ROUTER_CONFIG, {"prefill": 2, "decode": 2})
    yield c
    c.stop()
