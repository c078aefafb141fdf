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
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pagedserve import __version__
from pagedserve.cli import DEFAULT_MAX_TOKENS
from pagedserve.common import shm
from pagedserve.common.api.limits import ConfigError
from pagedserve.common.api.settings import LAUNCHER_LINKS, ArgumentParser, Root, Schema
from pagedserve.common.core.config import EngineConfig
from pagedserve.common.runtime.tls import TLSFiles
from pagedserve.common.runtime.worker import WorkerConfig
from pagedserve.router.admin import ScaleResult
from pagedserve.router.auth import Authenticator, load_keys_file
from pagedserve.router.config import DEFAULT_PORT, RouterConfig

logger = logging.getLogger("pagedserve.launch")
ACTOR_PREFIX = "pagedserve-"  # worker actors are named pagedserve-prefill-0, ...


@dataclass
class ClusterSpec:
    """What `pagedserve up` starts; its fields are the command's flags (see
    pagedserve/common/api/settings.py for how a field becomes a flag)."""

    # A local HF checkpoint dir, or an Org/Name id already in the local Hugging Face
    # cache; None: the default model (SmolLM2-135M-Instruct).
    model: str | None = None
    num_prefill: int = 1  # prefill workers
    num_decode: int = 1  # decode workers
    engine: EngineConfig = field(default_factory=EngineConfig)  # every worker's engine
    router_host: str = "127.0.0.1"  # where the router listens
    router_port: int = DEFAULT_PORT  # the router's public port
    listen_host: str = "127.0.0.1"  # where workers listen; "0.0.0.0" across machines
    ray_address: str | None = None  # None: a private local Ray; "auto": join `ray start`
    num_cpus: int | None = None  # for a private local Ray
    gpus_per_worker: float = 0.0
    # prefix index + worker registry in Redis (else embedded); may carry a password
    redis_url: str | None = field(default=None, repr=False)
    lease_ttl_s: float = 30.0  # exported KV not pulled within this is freed (its router died)
    heartbeat_interval_s: float = 1.0  # workers -> router registry
    worker_timeout_s: float = 3.0  # a worker without a heartbeat this long leaves routing
    # Prompts whose uncached part is shorter skip the prefill hop (RouterConfig's: one
    # default; 32 tokens prefill locally faster than a Prefill call plus a KV transfer).
    disagg_min_prompt_tokens: int = 32
    kv_transport: Literal["auto", "shm", "grpc"] = "auto"  # how KV moves between workers
    log_level: str = "WARNING"  # launcher and workers (Ray streams the workers' logs here)
    # RouterConfig fields beyond the ones above (the router's own flags fill it).
    router_options: dict[str, Any] = field(default_factory=dict)
    # WorkerConfig fields every worker gets as they are (the workers' own flags fill it).
    worker_options: dict[str, Any] = field(default_factory=dict)
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
    # Workers' gRPC port (Prefill, Decode, KV transfer): None = any free port; P: as
    # worker_metrics_port (P with pool_resources, else P + k), so that firewalls and
    # NetworkPolicies can name one port.
    worker_port: int | None = None
    # "vllm": router and workers also export vllm:* series
    metrics_compat: Literal["vllm"] | None = None
    # Place each worker on a node that offers one unit of the custom resource
    # "pagedserve_prefill" / "pagedserve_decode" (the KubeRay worker groups and the
    # `ray start --resources` of deploy/README.md do): one worker per pod or machine.
    pool_resources: bool = False
    # issue 12: http. The OpenAI-compatible API on router_host: None = off, 0 = any free.
    router_http_port: int | None = None
    # -- the two planes and TLS (issue 11; router/server.py, common/runtime/tls.py) --
    # The router's internal listener (Registry, PrefixIndex, Admin), what the workers
    # dial (as --advertise-host when given): loopback unless the workers are elsewhere.
    internal_host: str = "127.0.0.1"
    internal_port: int = 50052  # the router's internal port; 0 = any free one
    # TLS on the router's public port (certfile, keyfile; ca_certs: what --demo trusts).
    public_tls: TLSFiles | None = None
    # Mutual TLS on every internal connection (router <-> workers, worker <-> worker KV,
    # workers -> router): the same files on every node; certificates name the hosts
    # peers dial (--advertise-host, each worker's node address).
    internal_tls: TLSFiles | None = None

    def __post_init__(self) -> None:
        if self.internal_tls is not None:
            self.internal_tls.require_ca("--internal-ssl-* (mutual TLS)")


class Cluster:
    """A router in this process plus worker actors in Ray; `stop()` tears it all down."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.router: Any = None
        self.prefill: list[Any] = []
        self.decode: list[Any] = []
        self._owns_ray = False
        self._port_offsets: dict[str, int] = {}  # worker id -> its ports' offset
        self._pools_lock = threading.Lock()  # scale() and stop() change the pools

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
            init_local_ray(
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

        from pagedserve.router.server import start_router_in_thread

        spec = self.spec
        self.start_ray(progress)
        progress("starting the router ...")
        self.router = start_router_in_thread(self.router_config())
        progress(
            f"router listening on {self.router.address} "
            f"(internal plane on {self.router.internal_address})"
        )
        self.router.router.scaler = self.scale  # Admin.Scale: `pagedserve scale`
        if self.router.router.metrics.server is not None:
            progress(
                f"router metrics on http://{self.router.router.metrics.server.address}/metrics"
            )
        if self.router.router.http is not None:  # issue 12: http
            http = self.router.router.http
            progress(f"OpenAI-compatible API on {http.scheme}://{http.address}/v1")
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

    def router_config(self) -> RouterConfig:
        """The router's config: the spec's router settings, the engine's limits
        (settings.LAUNCHER_LINKS), then router_options."""
        spec = self.spec
        linked: dict[str, Any] = dict(
            max_model_len=spec.engine.scheduler.max_model_len,
            max_n=spec.engine.max_n,
            max_logprobs=spec.engine.max_logprobs,
        )
        return RouterConfig(
            host=spec.router_host,
            port=spec.router_port,
            model=spec.model,
            worker_timeout_s=spec.worker_timeout_s,
            disagg_min_prompt_tokens=spec.disagg_min_prompt_tokens,
            redis_url=spec.redis_url,  # None: the router hosts the prefix index
            metrics_port=spec.router_metrics_port,
            metrics_compat=spec.metrics_compat,
            http_port=spec.router_http_port,
            # The planes are linked settings (ClusterSpec's, shared with the workers).
            **{**linked, **spec.router_options, **self._router_planes()},
        )

    def _router_planes(self) -> dict[str, Any]:
        """The router's listeners and TLS, from the spec (issue 11)."""
        spec = self.spec
        return dict(
            internal_host=spec.internal_host,
            internal_port=spec.internal_port,
            public_tls=spec.public_tls,
            internal_tls=spec.internal_tls,
        )

    def worker_config(self, pool: str, index: int, router_address: str) -> WorkerConfig:
        """The config the `index`-th worker of `pool` receives (router_address: the
        router as the workers dial it)."""
        spec = self.spec
        return WorkerConfig(
            worker_id=f"{pool}-{index}",
            pool=pool,  # type: ignore[arg-type]
            engine=replace(spec.engine, model=spec.model),
            host=spec.listen_host,
            advertise_host=None if spec.listen_host != "0.0.0.0" else "auto",
            registry_address=router_address,
            heartbeat_interval_s=spec.heartbeat_interval_s,
            lease_ttl_s=spec.lease_ttl_s,
            kv_transport=spec.kv_transport,
            # The prefix index: Redis when configured (the workers also register there),
            # else the router's embedded index, served on the router's internal listener.
            redis_url=spec.redis_url,
            index_address=None if spec.redis_url else router_address,
            port=self._worker_port(spec.worker_port, pool, index) or 0,
            metrics_port=self._worker_port(spec.worker_metrics_port, pool, index),
            metrics_compat=spec.metrics_compat,
            **{**spec.worker_options, "internal_tls": spec.internal_tls},  # linked, as above
        )

    def kv_shm_dirs(self) -> list[str]:
        """Where this cluster's workers keep their KV cache files and segments (their
        kv_shm_dir, and the engine's own cache dir when the config names one)."""
        defaults = WorkerConfig.__dataclass_fields__["kv_shm_dir"].default
        dirs = [str(self.spec.worker_options.get("kv_shm_dir", defaults))]
        if self.spec.engine.cache.shm_dir is not None:
            dirs.append(str(self.spec.engine.cache.shm_dir))
        return list(dict.fromkeys(dirs))

    def _spawn(self, pool: str, index: int) -> Any:
        import ray

        from pagedserve.worker import DecodeWorkerActor, PrefillWorkerActor

        spec = self.spec
        cls = PrefillWorkerActor if pool == "prefill" else DecodeWorkerActor
        cfg = self.worker_config(pool, index, self.router_address_for_workers)
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
        if info.get("internal_tls", False) != (self.spec.internal_tls is not None):
            problems.append("its internal mutual TLS setting differs from this launcher's")
        if problems:
            raise RuntimeError(
                f"running worker {info['worker_id']} does not fit this router: "
                f"{'; '.join(problems)}. Start the router with the options the workers "
                "were started with (a stable --advertise-host and --port), or stop them "
                "first with `pagedserve down`"
            )

    @property
    def router_address_for_workers(self) -> str:
        """host:port of the router's internal listener (Registry, PrefixIndex) as the
        workers dial it; never the public port, which does not serve them."""
        return advertised_address(self.router.internal_address, self.spec.router_advertise_host)

    def _worker_port(self, base: int | None, pool: str, index: int) -> int | None:
        """The port of the `index`-th worker of `pool` from a base port (ClusterSpec's
        worker_port, worker_metrics_port): the base itself with pool_resources, else
        base + the worker's offset. Workers added by `scale` take the next offset no
        running worker holds (a freed offset is reused)."""
        if not base or self.spec.pool_resources:
            return base
        name = f"{pool}-{index}"
        if name not in self._port_offsets:
            k = index if pool == "prefill" else self.spec.num_prefill + index
            taken = set(self._port_offsets.values())
            if k in taken:
                k = next(i for i in range(len(taken) + 1) if i not in taken)
            self._port_offsets[name] = k
        return base + self._port_offsets[name]

    def wait_registered(
        self, timeout_s: float = 30.0, interrupted: Callable[[], bool] = lambda: False
    ) -> None:
        """Until the router routes to every worker (its registry saw their heartbeats)."""
        want = {f"prefill-{i}" for i in range(len(self.prefill))}
        want |= {f"decode-{i}" for i in range(len(self.decode))}
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

    # -- resizing (Admin.Scale, `pagedserve scale`) --------------------------------------

    def scale(
        self, prefill: int | None, decode: int | None, drain_timeout_s: float | None = None
    ) -> ScaleResult:
        """Resizes the pools to `prefill` / `decode` workers (None: unchanged).

        New workers take the next indices and are waited for until the router routes to
        them. Leaving workers are the highest-numbered: each drains first (no new
        requests reach it; it finishes those it holds and its exported KV is pulled,
        WorkerRuntime.drain), all at once, for at most `drain_timeout_s` (default the
        shutdown grace), then stops for good. Runs on the thread of whoever calls it
        (the router's Admin service runs it off its event loop).
        """
        import ray

        timeout = self.spec.shutdown_grace_s if drain_timeout_s is None else drain_timeout_s
        result = ScaleResult()
        with self._pools_lock:
            if self.router is None:
                raise RuntimeError("the cluster is stopping")
            leaving: list[tuple[str, Any]] = []
            joining: list[Any] = []
            for pool, want in (("prefill", prefill), ("decode", decode)):
                actors = self.prefill if pool == "prefill" else self.decode
                if want is None:
                    continue
                while len(actors) > want:
                    leaving.append((f"{pool}-{len(actors) - 1}", actors.pop()))
                while len(actors) < want:
                    actors.append(self._spawn(pool, len(actors)))
                    joining.append(actors[-1])
                    result.started.append(f"{pool}-{len(actors) - 1}")
            drains = [(wid, a, a.drain_and_stop.remote(timeout)) for wid, a in leaving]
            unclean = False  # a worker killed before it stopped: its KV files are left
            for wid, actor, ref in drains:
                try:
                    emptied = ray.get(ref, timeout=timeout + 30)
                except Exception as e:  # dead already, or stuck past its own timeout
                    logger.warning("worker %s did not drain cleanly: %s", wid, e)
                    emptied = False
                    unclean = True
                ray.kill(actor, no_restart=True)
                self._port_offsets.pop(wid, None)
                result.stopped.append(wid)
                if not emptied:
                    result.cut.append(wid)
            _wait_gone([actor for _, actor in leaving], 10.0)  # "stopped" means gone
            if unclean:
                sweep_stale_kv_files(self.kv_shm_dirs())
            for actor in joining:  # loading the model: as long as a start may take
                self._check_attached(ray.get(actor.describe.remote(), timeout=600))
            if joining:
                self.wait_registered(timeout_s=180.0 if self.spec.detach_workers else 60.0)
            self.spec = replace(
                self.spec, num_prefill=len(self.prefill), num_decode=len(self.decode)
            )
            result.prefill, result.decode = len(self.prefill), len(self.decode)
        logger.info(
            "scaled to %d prefill + %d decode (started %s, stopped %s)",
            result.prefill,
            result.decode,
            result.started,
            result.stopped,
        )
        return result

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

        grace = self.spec.shutdown_grace_s if grace_s is None else grace_s
        with self._pools_lock:
            self._stop_locked(grace, progress)

    def _stop_locked(self, grace: float, progress) -> None:
        import ray

        if self.router is not None:
            cut = self.router.drain(grace)
            progress(f"router drained ({cut} stream(s) cut at the grace period)")
        if self.spec.detach_workers:
            if self.prefill or self.decode:
                progress("leaving the detached workers running")
        else:
            stop_workers(self.prefill + self.decode, shm_dirs=self.kv_shm_dirs())
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


def init_local_ray(**kwargs: Any) -> Any:
    """`ray.init(address="local", **kwargs)`, tried a second time if the node's start timed out.

    Ray waits a fixed 30 s for its raylet to register with the GCS (not configurable);
    on a loaded machine (a CI runner, two cores shared with other jobs) the first start
    can miss that window and raise "The current node timed out during startup" while a
    second start succeeds. Any other error, or a second timeout, is raised as is.
    """
    import ray

    try:
        return ray.init(address="local", **kwargs)
    except Exception as e:  # Ray raises a bare Exception for this one
        if "timed out during startup" not in str(e):
            raise
        logger.warning("Ray's node did not start in time (%s); starting it again", e)
        ray.shutdown()
        return ray.init(address="local", **kwargs)


def stop_workers(actors: list[Any], timeout_s: float = 10.0, shm_dirs: Sequence[str] = ()) -> None:
    """Stops worker actors for good: Goodbye to the registries, then no restart.

    Every actor is asked at once and all get one `timeout_s` together, not one each:
    an actor still in its constructor (a stop signal while the model loads) runs
    `stop` only once that returns, and waiting for those one after another made a
    launcher stopped during start-up take ~10 s per such worker to exit. An actor that
    has not stopped by then is killed as it is; so is one whose stop failed. Such a
    worker never closed its KV cache file (tmpfs memory the size of its cache): when
    any did, its dead files in `shm_dirs` (the workers' kv_shm_dir) are swept on every
    node once it is gone (`sweep_stale_kv_files`).

    Returns once every actor is gone (or after another `timeout_s`): `ray.kill` only
    asks the GCS, and until that reaches the actor's process a call made right after
    (a `scale` caller's, say) could still be served by a worker reported as stopped.
    """
    import ray

    refs = []
    unclean = 0  # stopped otherwise than by their own `stop`: their files may be left
    for actor in actors:
        try:
            refs.append(actor.stop.remote())
        except Exception as e:  # already dead: nothing to stop
            logger.debug("stopping an actor failed: %s", e)
            unclean += 1
    if refs:
        done, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if late:
            logger.warning("%d worker(s) did not stop within %g s: killed", len(late), timeout_s)
        unclean += len(late)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:  # died before or during its stop
                logger.debug("a worker's stop failed: %s", e)
                unclean += 1
    for actor in actors:
        ray.kill(actor, no_restart=True)
    _wait_gone(actors, timeout_s)
    if unclean and shm_dirs:
        sweep_stale_kv_files(shm_dirs)


def sweep_stale_kv_files(shm_dirs: Sequence[str], timeout_s: float = 30.0) -> list[str]:
    """Unlinks, on every live node of the Ray cluster, the KV cache files and KV
    segments in `shm_dirs` whose process is gone; returns their paths.

    A worker killed before it closed its KV cache (it did not stop in time, or crashed)
    leaves the cache's /dev/shm file behind: tmpfs memory the size of its KV cache,
    otherwise held until the next worker starts on that node (a worker sweeps its
    kv_shm_dir at start), and for good on a node where none does. Only files of dead
    processes are touched (`shm.remove_stale_kv_files_in`), so the live workers of other
    clusters sharing a node keep theirs. Best effort: a node that does not answer
    within `timeout_s` is logged, never raised (a stop must not fail on a sweep).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    dirs = [str(d) for d in dict.fromkeys(shm_dirs)]
    # A task on each node (num_cpus=0: runs beside busy workers), pickled by reference
    # to common/shm.py: standard library only, so the task does not load torch.
    sweep = ray.remote(num_cpus=0, max_retries=0)(shm.remove_stale_kv_files_in)
    refs = {}
    for node in ray.nodes():
        if node.get("Alive"):
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            ref = sweep.options(scheduling_strategy=strategy).remote(dirs)
            refs[ref] = node.get("NodeManagerAddress") or node["NodeID"]
    done, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    removed: list[str] = []
    for ref in done:
        try:
            paths = ray.get(ref)
        except Exception as e:
            logger.warning("sweeping KV files on node %s failed: %s", refs[ref], e)
            continue
        if paths:
            logger.warning(
                "removed %d KV file(s) of dead workers on node %s: %s",
                len(paths),
                refs[ref],
                ", ".join(paths),
            )
        removed += paths
    for ref in late:
        logger.warning("node %s did not sweep its KV files within %g s", refs[ref], timeout_s)
        with contextlib.suppress(Exception):
            ray.cancel(ref)
    return sorted(removed)


def _wait_gone(actors: list[Any], timeout_s: float) -> None:
    """Until a call to each killed actor fails with RayActorError (it is dead), bounded."""
    import ray

    deadline = time.monotonic() + timeout_s
    pending = list(actors)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            logger.warning("%d killed worker(s) still answer after %g s", len(pending), timeout_s)
            return
        alive = []
        for actor in pending:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=max(0.05, min(1.0, left)))
                alive.append(actor)  # answered: the kill has not landed yet
            except ray.exceptions.GetTimeoutError:
                alive.append(actor)
            except ray.exceptions.RayActorError:
                pass  # gone
        pending = alive
        if pending:
            time.sleep(0.05)


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


@dataclass(frozen=True)
class LaunchOptions:
    """`pagedserve up` flags that configure no component."""

    # answer this one chat message, then stop (over gRPC: no HTTP port is opened, so a
    # busy port 8000 on this machine cannot stop the demo)
    demo: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS  # for --demo (the same default as `generate`)


def settings_schema() -> Schema:
    """`pagedserve up`'s settings: ClusterSpec (engine included), the router's and the
    workers' own settings (common/api/settings.py)."""
    return Schema(
        prog="pagedserve up",
        description=__doc__.split("\n\n")[0],
        roots=[
            Root("spec", ClusterSpec),
            Root("router", RouterConfig, partial=True),
            Root("worker", WorkerConfig, partial=True),
            Root("launch", LaunchOptions),
        ],
        version=__version__,
        links=LAUNCHER_LINKS,
    )


def build_parser() -> ArgumentParser:
    return settings_schema().parser()


def parse_spec(argv: list[str] | None = None) -> tuple[ClusterSpec, LaunchOptions]:
    """The command line (and its --config file) as a ClusterSpec, model unresolved."""
    schema = settings_schema()
    parser = schema.parser()
    args = parser.parse_args(argv)
    if args.detach_workers and (
        args.ray_address is None or args.port == 0 or args.internal_port == 0
    ):
        # Detached workers must outlive this process (so must their Ray cluster) and
        # find the next router where they found this one.
        parser.error(
            "--detach-workers needs --ray-address (a Ray cluster) and a fixed --port and "
            "--internal-port"
        )
    built = schema.build(args, parser)
    spec = replace(built["spec"], router_options=built["router"], worker_options=built["worker"])
    try:  # the router's API keys: a bad keys file is a usage error naming its line
        authenticator(spec)
    except ConfigError as e:
        parser.error(str(e))
    options = built["launch"]
    if options.demo is not None:
        spec = replace(spec, router_http_port=None)
    return spec, options


def authenticator(spec: ClusterSpec) -> Authenticator:
    opts = spec.router_options
    return Authenticator.from_config(opts.get("api_key"), opts.get("api_keys_file"))


def demo_key(spec: ClusterSpec) -> str | None:
    """A key `--demo`'s request can present: --api-key, else the keys file's first."""
    key, path = spec.router_options.get("api_key"), spec.router_options.get("api_keys_file")
    if key or not path:
        return key
    return next(iter(load_keys_file(path)))


def main(argv: list[str] | None = None) -> int:
    spec, options = parse_spec(argv)
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(name)s: %(message)s")
    progress = _progress_printer()
    from pagedserve.common.api.checkpoint import is_default_model
    from pagedserve.common.core.loader import resolve_model_dir

    if is_default_model(spec.model):
        progress("preparing the default model (first run: dequantizing the GGUF, ~30 s) ...")
    spec = replace(spec, model=str(resolve_model_dir(spec.model, progress=progress)))
    cluster = Cluster(spec)
    signals = StopSignals()
    try:
        cluster.start_ray(progress)
        signals.install()  # after ray.init, which installs its own SIGTERM handler
        cluster.start(progress=progress, interrupted=signals.requested)
        if options.demo is not None:
            key = demo_key(spec)  # the demo request presents a key too
            ca = spec.public_tls.ca_certs if spec.public_tls is not None else None
            return _demo(cluster.address, options.demo, options.max_tokens, key, ca)
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
    p.add_argument(
        "--kv-shm-dir",
        action="append",
        help="the workers' kv_shm_dir, where a worker killed on the way out leaves its KV "
        f"files (swept on every node; repeat for several; default {shm.SHM_DIR})",
    )
    args = p.parse_args(argv)
    import ray

    ray.init(address=args.ray_address, namespace=args.ray_namespace, logging_level=logging.WARNING)
    try:
        names = sorted(
            n
            for n in ray.util.list_named_actors(all_namespaces=False)
            if n.startswith(ACTOR_PREFIX)
        )
        dirs = args.kv_shm_dir or [str(shm.SHM_DIR)]
        stop_workers([ray.get_actor(n) for n in names], shm_dirs=dirs)
    finally:
        ray.shutdown()
    print(f"stopped {len(names)} worker(s){': ' if names else ''}{', '.join(names)}", flush=True)
    return 0


def _demo(
    address: str,
    message: str,
    max_tokens: int,
    api_key: str | None = None,
    ssl_ca_certs: str | None = None,
) -> int:
    from pagedserve.router.client import Client

    print(f"\nuser> {message}\nassistant> ", end="", flush=True)
    with Client(address, api_key=api_key, ssl_ca_certs=ssl_ca_certs) as client:
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
