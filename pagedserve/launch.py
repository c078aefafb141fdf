"""`pagedserve up`: bring up a router and Ray-managed prefill and decode workers.

Ray is the control plane: it starts the worker actors, places them (on GPUs where
there are some), and restarts one that dies (`max_restarts=-1`); a restarted worker
registers itself again with the router through its heartbeats, under the same
worker id. gRPC is the data plane. The router runs in this (the driver's) process.

    pagedserve up                         # 1 prefill + 1 decode, default model, serve
    pagedserve up --demo "Hi there"       # ... answer one chat request, then stop
    pagedserve up --ray-address auto --listen-host 0.0.0.0   # join a `ray start` cluster
    pagedserve up --metrics-port 9400 --worker-metrics-port 9401   # Prometheus endpoints

On Kubernetes (deploy/k8s) the launcher dials a KubeRay cluster through Ray Client
(`--ray-address ray://HEAD:10001`), pins each worker to a pod of its pool's worker
group (`--pool-resources`) and tells the workers the router's pod IP
(`--advertise-host`); see deploy/README.md.

Stopping. SIGTERM (Kubernetes, systemd) and Ctrl-C drain: the router stops admitting
(new requests: UNAVAILABLE "router is shutting down"; health: NOT_SERVING), the
streams in flight get `--shutdown-grace-s` to finish (the rest end UNAVAILABLE; a
second signal ends the grace at once), the workers this process owns say Goodbye
(router and Redis registry) and stop, Ray shuts down, and the process exits 0. The
handlers are installed after `ray.init`, which sets its own SIGTERM handler (exit at
once), and put back when the launcher returns.

Restarting the router alone (a rollout of the router's Deployment). With
`--detach-workers` the workers are detached, named Ray actors
(`pagedserve-prefill-0`, ... in Ray namespace `--ray-namespace`): they outlive the
launcher, which then only drains its router on SIGTERM. The next launcher started
with the same options attaches to the running workers by name instead of starting
new ones (same worker ids, no model reload); they register with its router by their
next heartbeats, since they keep dialing the address they were given: that address
must therefore outlive the router (a fixed host:port on one machine; on Kubernetes a
Service name as `--advertise-host`, which gRPC resolves again on reconnecting; with
`--redis-url` the Redis registry carries them regardless). Leases that the dead
router's requests left open are freed by the workers after their TTL
(`--lease-ttl-s`); its open streams were cancelled with its connections, so their
blocks are already back. It needs a Ray cluster that outlives the launcher
(`--ray-address`); `pagedserve down --ray-address ...` stops detached workers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pagedserve.common.core.config import CacheConfig, EngineConfig, GiB, SchedulerConfig
from pagedserve.common.runtime.worker import WorkerConfig

logger = logging.getLogger("pagedserve.launch")
ACTOR_PREFIX = "pagedserve-"  # worker actors are named pagedserve-prefill-0, ...


@dataclass
class ClusterSpec:
    model: str | None = None
    num_prefill: int = 1
    num_decode: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    router_host: str = "127.0.0.1"
    router_port: int = 50051
    listen_host: str = "127.0.0.1"  # where workers listen; "0.0.0.0" across machines
    ray_address: str | None = None  # None: a private local Ray; "auto": join `ray start`
    num_cpus: int | None = None  # for a private local Ray
    gpus_per_worker: float = 0.0
    redis_url: str | None = None
    lease_ttl_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    worker_timeout_s: float = 3.0
    disagg_min_prompt_tokens: int = 0
    kv_transport: str = "auto"
    log_level: str = "WARNING"
    router_options: dict[str, Any] = field(default_factory=dict)
    # -- lifecycle (see the module docstring) --
    shutdown_grace_s: float = 25.0  # under Kubernetes' default 30 s termination grace
    detach_workers: bool = False  # workers outlive the launcher; attach to running ones
    # Where detached workers' actor names live. Owned workers keep the driver's own
    # anonymous namespace, so that two launchers can share one Ray cluster.
    ray_namespace: str = "pagedserve"
    # -- operations (deploy/README.md) --
    # The address workers dial for the router's Registry and PrefixIndex services; None =
    # router_host (which must then be reachable from every worker: not 0.0.0.0).
    router_advertise_host: str | None = None
    router_metrics_port: int | None = None  # router's /metrics; None = off, 0 = any free
    # Workers' /metrics: None = off, 0 = any free port; P: every worker listens on P when
    # each has a node of its own (pool_resources), else the k-th worker (prefill first)
    # on P + k, so that workers sharing a machine never collide.
    worker_metrics_port: int | None = None
    metrics_compat: str | None = None  # "vllm": router and workers also export vllm:* series
    # Place each worker on a node that offers one unit of the custom resource
    # "pagedserve_prefill" / "pagedserve_decode" (the KubeRay worker groups and the
    # `ray start --resources` of deploy/README.md do): one worker per pod or machine.
    pool_resources: bool = False
    # issue 12: http. The OpenAI-compatible API on router_host: None = off, 0 = any free.
    router_http_port: int | None = None


class Cluster:
    """A router in this process plus worker actors in Ray; `stop()` tears it all down."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.router: Any = None
        self.prefill: list[Any] = []
        self.decode: list[Any] = []
        self._owns_ray = False

    # -- bring-up -----------------------------------------------------------------------

    def start_ray(self, progress=print) -> None:
        """ray.init unless Ray is up (start() calls it; main() first, to set signals)."""
        import ray

        spec = self.spec
        if spec.detach_workers and spec.ray_address is None:
            raise ValueError(
                "detached workers need a Ray cluster that outlives this process: "
                "give --ray-address (e.g. auto after `ray start --head`)"
            )
        if ray.is_initialized():
            return
        namespace = spec.ray_namespace if spec.detach_workers else None
        progress("starting Ray ..." if spec.ray_address is None else "connecting to Ray ...")
        if spec.ray_address is None:
            # A private single-machine Ray, bound to loopback (see ENV notes).
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            ray.init(
                address="local",
                num_cpus=spec.num_cpus,
                include_dashboard=False,
                logging_level=logging.WARNING,
                runtime_env={"env_vars": _worker_env()},
                namespace=namespace,
            )
        else:
            ray.init(
                address=spec.ray_address,
                logging_level=logging.WARNING,
                namespace=namespace,
            )
        self._owns_ray = True

    def start(
        self,
        progress=print,
        timeout_s: float = 600.0,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> Cluster:
        """Starts the router and the workers; returns once the router routes to them.

        `interrupted` is polled about once a second while waiting for the workers (a
        stop signal's flag): True raises StopRequested. (Raising from the signal
        handler itself is unsafe: it can land inside Ray's Cython code.)
        """
        import ray

        from pagedserve.router.server import RouterConfig, start_router_in_thread

        spec = self.spec
        self.start_ray(progress)
        progress("starting the router ...")
        self.router = start_router_in_thread(
            RouterConfig(
                host=spec.router_host,
                port=spec.router_port,
                model=spec.model,
                worker_timeout_s=spec.worker_timeout_s,
                disagg_min_prompt_tokens=spec.disagg_min_prompt_tokens,
                redis_url=spec.redis_url,  # None: the router hosts the prefix index
                metrics_port=spec.router_metrics_port,
                metrics_compat=spec.metrics_compat,  # type: ignore[arg-type]
                http_port=spec.router_http_port,  # issue 12: http
                **spec.router_options,
            )
        )
        progress(f"router listening on {self.router.address}")
        if self.router.router.metrics.server is not None:
            progress(
                f"router metrics on http://{self.router.router.metrics.server.address}/metrics"
            )
        if self.router.router.http is not None:  # issue 12: http
            progress(f"OpenAI-compatible API on http://{self.router.router.http.address}/v1")
        progress(
            f"starting {spec.num_prefill} prefill + {spec.num_decode} decode worker(s) "
            "(loading the model) ..."
        )
        for i in range(spec.num_prefill):
            self.prefill.append(self._spawn("prefill", i))
        for i in range(spec.num_decode):
            self.decode.append(self._spawn("decode", i))
        t0 = time.monotonic()
        for actor in self.prefill + self.decode:
            ref = actor.describe.remote()
            while not ray.wait([ref], timeout=1.0)[0]:
                if interrupted():
                    raise StopRequested
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"a worker did not start within {timeout_s:g} s")
            info = ray.get(ref)
            self._check_attached(info)
            progress(
                f"  worker {info['worker_id']} up at {info['address']} ({time.monotonic() - t0:.0f} s)"
            )
        # Attached workers may have been failing to reach a dead router for a while:
        # their heartbeat channel then retries on gRPC's reconnect backoff (up to 120 s,
        # +-20% jitter) before it finds this one.
        self.wait_registered(
            timeout_s=180.0 if spec.detach_workers else 30.0, interrupted=interrupted
        )
        progress("cluster ready")
        return self

    def _spawn(self, pool: str, index: int) -> Any:
        import ray

        from pagedserve.worker import DecodeWorkerActor, PrefillWorkerActor

        spec = self.spec
        cls = PrefillWorkerActor if pool == "prefill" else DecodeWorkerActor
        cfg = WorkerConfig(
            worker_id=f"{pool}-{index}",
            pool=pool,  # type: ignore[arg-type]
            engine=replace(spec.engine, model=spec.model),
            host=spec.listen_host,
            advertise_host=None if spec.listen_host != "0.0.0.0" else "auto",
            registry_address=self.router_address_for_workers,
            heartbeat_interval_s=spec.heartbeat_interval_s,
            lease_ttl_s=spec.lease_ttl_s,
            kv_transport=spec.kv_transport,  # type: ignore[arg-type]
            # The prefix index: Redis when configured (the workers also register there),
            # else the router's embedded index, served at the router's address.
            redis_url=spec.redis_url,
            index_address=None if spec.redis_url else self.router_address_for_workers,
            metrics_port=self._worker_metrics_port(pool, index),
            metrics_compat=spec.metrics_compat,  # type: ignore[arg-type]
        )
        # Detached: the actor outlives this driver, and a running one of that name is
        # attached to (get_if_exists: its constructor does not run again).
        detached = {}
        if spec.detach_workers:
            detached = dict(lifetime="detached", get_if_exists=True, namespace=spec.ray_namespace)
        remote_cls = ray.remote(cls).options(
            name=f"{ACTOR_PREFIX}{pool}-{index}",
            max_restarts=-1,  # Ray restarts a dead worker; it re-registers by heartbeat
            max_task_retries=0,
            max_concurrency=8,
            num_cpus=0,  # torch threads are set by EngineConfig.num_threads instead
            num_gpus=spec.gpus_per_worker,
            resources={f"pagedserve_{pool}": 1} if spec.pool_resources else None,
            **detached,
        )
        return remote_cls.remote(cfg, spec.log_level)

    def _check_attached(self, info: dict[str, Any]) -> None:
        """A worker must dial this router and serve its model (an attached one may not)."""
        want = self.router_address_for_workers
        problems = []
        if info["registry_address"] != want:
            problems.append(f"it dials the router at {info['registry_address']}, not {want}")
        if info["model"] != self.spec.model:
            problems.append(f"it serves {info['model']}, not {self.spec.model}")
        if problems:
            raise RuntimeError(
                f"running worker {info['worker_id']} does not fit this router: "
                f"{'; '.join(problems)}. Start the router with the options the workers "
                "were started with (a stable --advertise-host and --port), or stop them "
                "first with `pagedserve down`"
            )

    @property
    def router_address_for_workers(self) -> str:
        """host:port of the router as the workers dial it."""
        return advertised_address(self.router.address, self.spec.router_advertise_host)

    def _worker_metrics_port(self, pool: str, index: int) -> int | None:
        """See ClusterSpec.worker_metrics_port."""
        base = self.spec.worker_metrics_port
        if not base or self.spec.pool_resources:
            return base
        k = index if pool == "prefill" else self.spec.num_prefill + index
        return base + k

    def wait_registered(
        self, timeout_s: float = 30.0, interrupted: Callable[[], bool] = lambda: False
    ) -> None:
        """Until the router routes to every worker (its registry saw their heartbeats)."""
        want = {f"prefill-{i}" for i in range(self.spec.num_prefill)}
        want |= {f"decode-{i}" for i in range(self.spec.num_decode)}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if want <= set(self.router.live_worker_ids()):
                return
            if interrupted():
                raise StopRequested
            time.sleep(0.1)
        raise TimeoutError(
            f"workers {sorted(want - set(self.router.live_worker_ids()))} never registered"
        )

    @property
    def address(self) -> str:
        return self.router.address

    # -- tear-down ----------------------------------------------------------------------

    def end_grace(self) -> None:
        """Ends the router's drain grace period now (safe from a signal handler)."""
        if self.router is not None:
            self.router.end_grace()

    def stop(self, grace_s: float | None = None, progress=lambda _msg: None) -> None:
        """Drains the router (`grace_s`, default spec.shutdown_grace_s), then stops the
        workers this process owns (not detached ones), the router and Ray.

        The workers stop while the router still serves, so that their Goodbye reaches
        it (and their Redis tombstone is written) before it goes.
        """
        import ray

        grace = self.spec.shutdown_grace_s if grace_s is None else grace_s
        if self.router is not None:
            cut = self.router.drain(grace)
            progress(f"router drained ({cut} stream(s) cut at the grace period)")
        if self.spec.detach_workers:
            if self.prefill or self.decode:
                progress("leaving the detached workers running")
        else:
            stop_workers(self.prefill + self.decode)
        self.prefill, self.decode = [], []
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_workers(actors: list[Any]) -> None:
    """Stops worker actors for good: Goodbye to the registries, then no restart."""
    import ray

    for actor in actors:
        try:
            ray.get(actor.stop.remote(), timeout=10)
        except Exception as e:  # already dead: nothing to stop
            logger.debug("stopping an actor failed: %s", e)
        ray.kill(actor, no_restart=True)


def advertised_address(bound: str, advertise_host: str | None) -> str:
    """`bound` (host:port) with its host replaced by `advertise_host` when given."""
    if advertise_host is None:
        return bound
    return f"{advertise_host}:{bound.rsplit(':', 1)[1]}"


def _worker_env() -> dict[str, str]:
    keep = (
        "HF_HUB_OFFLINE",
        "PAGEDSERVE_CACHE_DIR",
        "TRITON_INTERPRET",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    )
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


# -- the command -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve up", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=None,
        help="a local HF checkpoint dir, or an Org/Name id already in the local Hugging Face cache (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--port", type=int, default=50051, help="router port")
    p.add_argument("--host", default="127.0.0.1", help="router listen address")
    p.add_argument("--listen-host", default="127.0.0.1", help="workers' listen address")
    p.add_argument("--ray-address", default=None, help="join a Ray cluster ('auto' = ray start)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache budget per worker")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads-per-worker", type=int, default=None, help="torch threads")
    p.add_argument("--gpus-per-worker", type=float, default=0.0)
    p.add_argument("--redis-url", default=None, help="prefix index / registry in Redis")
    p.add_argument(
        "--advertise-host", default=None, help="router address the workers dial (default --host)"
    )
    p.add_argument(
        "--metrics-port", type=int, default=None, help="router Prometheus port (0 = any free)"
    )
    p.add_argument(
        "--worker-metrics-port",
        type=int,
        default=None,
        help="workers' Prometheus port: P with --pool-resources, else P + k for the k-th worker",
    )
    p.add_argument(
        "--metrics-compat",
        choices=["vllm"],
        default=None,
        help="router and workers also export vLLM-named series (vllm:*) for the inference "
        "gateway and vLLM's dashboards",
    )
    p.add_argument(
        "--pool-resources",
        action="store_true",
        help="one worker per node offering the pagedserve_prefill/_decode custom resource",
    )
    p.add_argument(
        "--demo", default=None, metavar="MESSAGE", help="answer one chat message, then stop"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="for --demo")
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=ClusterSpec.shutdown_grace_s,
        help="on SIGTERM/Ctrl-C: seconds the streams in flight get to finish",
    )
    p.add_argument(
        "--detach-workers",
        action="store_true",
        help="workers outlive this process (detached Ray actors); reuse running ones on start",
    )
    p.add_argument("--ray-namespace", default=ClusterSpec.ray_namespace)
    p.add_argument(
        "--lease-ttl-s",
        type=float,
        default=ClusterSpec.lease_ttl_s,
        help="exported KV not pulled within this is freed (e.g. its router died)",
    )
    p.add_argument("--log-level", default="WARNING")
    # issue 12: http
    from pagedserve.router.__main__ import add_http_flags

    add_http_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.detach_workers and (args.ray_address is None or args.port == 0):
        # Detached workers must outlive this process (so must their Ray cluster) and
        # find the next router where they found this one.
        parser.error("--detach-workers needs --ray-address (a Ray cluster) and a fixed --port")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    progress = _progress_printer()
    from pagedserve.common.api.checkpoint import is_default_model
    from pagedserve.common.core.loader import resolve_model_dir

    if is_default_model(args.model):
        progress("preparing the default model (first run: dequantizing the GGUF, ~30 s) ...")
    model_dir = resolve_model_dir(args.model, progress=progress)
    spec = ClusterSpec(
        model=str(model_dir),
        num_prefill=args.prefill,
        num_decode=args.decode,
        engine=EngineConfig(
            dtype=args.dtype,
            device=args.device,
            cache=CacheConfig(
                block_size=args.block_size, kv_cache_bytes=int(args.kv_cache_gib * GiB)
            ),
            scheduler=SchedulerConfig(),
            num_threads=args.threads_per_worker,
        ),
        router_host=args.host,
        router_port=args.port,
        listen_host=args.listen_host,
        ray_address=args.ray_address,
        gpus_per_worker=args.gpus_per_worker,
        redis_url=args.redis_url,
        log_level=args.log_level,
        router_advertise_host=args.advertise_host,
        router_metrics_port=args.metrics_port,
        worker_metrics_port=args.worker_metrics_port,
        metrics_compat=args.metrics_compat,
        pool_resources=args.pool_resources,
        shutdown_grace_s=args.shutdown_grace_s,
        detach_workers=args.detach_workers,
        ray_namespace=args.ray_namespace,
        lease_ttl_s=args.lease_ttl_s,
        router_http_port=None if args.no_http else args.http_port,  # issue 12: http
    )
    cluster = Cluster(spec)
    signals = StopSignals()
    try:
        cluster.start_ray(progress)
        signals.install()  # after ray.init, which installs its own SIGTERM handler
        cluster.start(progress=progress, interrupted=signals.requested)
        if args.demo is not None:
            return _demo(cluster.address, args.demo, args.max_tokens)
        print(f"pagedserve serving on {cluster.address}  (Ctrl-C to stop)", flush=True)
        signum = signals.wait(on_again=cluster.end_grace)
        progress(
            f"{signal.Signals(signum).name}: draining (up to {spec.shutdown_grace_s:g} s for "
            "the streams in flight; signal again to end them now) ..."
        )
        return 0
    except StopRequested:  # a signal while starting up: nothing in flight yet
        progress(f"{signals.name()} while starting up")
        return 0
    finally:
        progress("stopping ...")
        try:
            cluster.stop(progress=progress)
        finally:
            signals.restore()
        progress("stopped")


class StopRequested(Exception):
    """A stop signal came while the launcher was still starting up."""


class StopSignals:
    """SIGTERM and SIGINT as a request to stop, for the main thread.

    The handler only records: the first signal sets `requested()` (startup polls
    it) and returns from `wait()`; later ones call `on_again` (end the drain's grace
    period now). `restore()` puts back the handlers found by `install()` (after
    ray.init: Ray's own, which exits at once). Python's handler also replaces the
    C-level one Ray's core worker installs, so no stack dump.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._received: int | None = None
        self._on_again: Callable[[], None] | None = None
        self._event = threading.Event()

    def install(self) -> None:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: object) -> None:
        if self._received is None:
            self._received = signum
            self._event.set()
        elif self._on_again is not None:
            self._on_again()

    def requested(self) -> bool:
        return self._received is not None

    def name(self) -> str:
        return "no signal" if self._received is None else signal.Signals(self._received).name

    def wait(self, on_again: Callable[[], None] | None = None) -> int:
        """Blocks until a signal; returns its number."""
        self._on_again = on_again
        while not self._event.wait(1.0):  # wakes for signals (handlers run between waits)
            pass
        assert self._received is not None
        return self._received


def down_main(argv: list[str] | None = None) -> int:
    """`pagedserve down`: stops the detached workers of `pagedserve up --detach-workers`.

    Each says Goodbye (router, Redis registry) and its actor is killed for good. The
    router, if one runs, keeps serving (with no workers) until it is stopped itself.
    """
    p = argparse.ArgumentParser(prog="pagedserve down", description=down_main.__doc__)
    p.add_argument("--ray-address", default="auto", help="the Ray cluster the workers run in")
    p.add_argument("--ray-namespace", default=ClusterSpec.ray_namespace)
    args = p.parse_args(argv)
    import ray

    ray.init(address=args.ray_address, namespace=args.ray_namespace, logging_level=logging.WARNING)
    try:
        names = sorted(
            n
            for n in ray.util.list_named_actors(all_namespaces=False)
            if n.startswith(ACTOR_PREFIX)
        )
        stop_workers([ray.get_actor(n) for n in names])
    finally:
        ray.shutdown()
    print(f"stopped {len(names)} worker(s){': ' if names else ''}{', '.join(names)}", flush=True)
    return 0


def _demo(address: str, message: str, max_tokens: int) -> int:
    from pagedserve.router.client import Client

    print(f"\nuser> {message}\nassistant> ", end="", flush=True)
    with Client(address) as client:
        for resp in client.generate(
            messages=[{"role": "user", "content": message}], max_tokens=max_tokens, temperature=0.0
        ):
            print(resp.text, end="", flush=True)
    print("\n")
    return 0


def _progress_printer():
    t0 = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return progress


if __name__ == "__main__":
    sys.exit(main())
