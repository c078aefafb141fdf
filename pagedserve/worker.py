"""Starting a worker: the runtime plus the servicers of both roles, and the Ray
actor classes of both pools.

The composition of the two roles lives here, above them, so that neither role
package imports the other (import-linter contract "roles").

Every worker serves Prefill (with ReleaseLease and KVTransfer: any worker can export
KV it holds) and Decode (a decode worker prefills locally when the router sends no
KV handle). Its pool only says which requests the router sends it.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace

from pagedserve.common.core.loader import LoadedModel
from pagedserve.common.runtime.prefix_index.connection import redact_url
from pagedserve.common.runtime.worker import WorkerConfig, WorkerRuntime
from pagedserve.decode_worker.servicer import DecodeServicer
from pagedserve.prefill_worker.servicer import PrefillServicer
from pagedserve.v1 import worker_pb2_grpc


def start_worker(config: WorkerConfig, loaded: LoadedModel | None = None) -> WorkerRuntime:
    """Loads the engine, registers the servicers, starts serving; returns the runtime."""
    rt = WorkerRuntime(config, loaded)
    worker_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(rt), rt.server)
    worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(rt), rt.server)
    return rt.start()


def auto_advertise_host(config: WorkerConfig) -> str:
    """What a worker listening on 0.0.0.0 tells its peers to dial.

    With mutual TLS its peers check the name in its certificate, and a certificate
    names hosts, not the pod IPs a scheduler hands out: it advertises its fully
    qualified name (under Kubernetes, `<pod>.<headless service>.<namespace>.svc...`,
    which deploy/'s certificates cover). Without TLS, this node's IP as Ray sees it.
    """
    if config.internal_tls is not None:
        return socket.getfqdn()
    import ray

    return ray.util.get_node_ip_address()


class WorkerActor:
    """The body of a worker's Ray actor (the roles' actor classes wrap it).

    Kept free of `ray` so it runs (and is tested) as a plain object too; the
    launcher applies `ray.remote` with restart and placement options.
    """

    def __init__(self, config: WorkerConfig, log_level: str = "INFO") -> None:
        logging.basicConfig(
            level=log_level, format=f"%(asctime)s {config.worker_id} %(name)s: %(message)s"
        )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if config.engine.num_threads:
            import torch

            torch.set_num_threads(config.engine.num_threads)
        if config.internal_tls is not None:
            # The paths were checked where the config was built, maybe on another node:
            # check them here too, where the worker reads them (a clear error, not gRPC's).
            replace(config.internal_tls)
        if config.advertise_host == "auto":  # listening on 0.0.0.0: advertise this node
            config = replace(config, advertise_host=auto_advertise_host(config))
        self.config = config
        self.runtime = start_worker(config)

    def address(self) -> str:
        return self.runtime.address

    def pid(self) -> int:
        return os.getpid()

    def describe(self) -> dict[str, str | int | bool | None]:
        """Who this worker is and whom it reports to: the launcher checks a running
        (detached) worker against its own options before attaching to it."""
        return {
            "worker_id": self.config.worker_id,
            "pool": self.config.pool,
            "address": self.runtime.address,
            "registry_address": self.config.registry_address,
            "redis_url": redact_url(self.config.redis_url) if self.config.redis_url else None,
            "internal_tls": self.config.internal_tls is not None,
            "model": self.config.engine.model,
            "pid": os.getpid(),
        }

    def stats(self) -> bytes:
        """WorkerStats, serialized (protobuf messages do not pickle across Ray)."""
        return self.runtime.stats().SerializeToString()

    def check_integrity(self) -> bool:
        self.runtime.check_integrity()
        return True

    def open_leases(self) -> int:
        return self.runtime.kv_source.open_leases

    def drain_and_stop(self, timeout_s: float) -> bool:
        """Finishes what this worker holds (at most `timeout_s`), then stops it; True
        when nothing was cut (WorkerRuntime.drain)."""
        emptied = self.runtime.drain(timeout_s)
        self.runtime.stop()
        return emptied

    def stop(self) -> None:
        self.runtime.stop()


class PrefillWorkerActor(WorkerActor):
    """A worker in the prefill pool (the launcher wraps it with `ray.remote`)."""

    def __init__(self, config: WorkerConfig, log_level: str = "INFO") -> None:
        super().__init__(replace(config, pool="prefill"), log_level)


class DecodeWorkerActor(WorkerActor):
    """A worker in the decode (or colocated) pool."""

    def __init__(self, config: WorkerConfig, log_level: str = "INFO") -> None:
        if config.pool == "prefill":
            config = replace(config, pool="decode")
        super().__init__(config, log_level)
