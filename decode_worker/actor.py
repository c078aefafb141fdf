"""The decode role's Ray actor: a worker runtime in the decode (or colocated) pool."""

from __future__ import annotations

from dataclasses import replace

from pagedserve.common.worker import WorkerConfig
from pagedserve.worker import WorkerActor


class DecodeWorkerActor(WorkerActor):
    def __init__(self, config: WorkerConfig, log_level: str = "INFO") -> None:
        if config.pool == "prefill":
            config = replace(config, pool="decode")
        super().__init__(config, log_level)
