"""The prefill role's Ray actor: a worker runtime in the prefill pool."""

from __future__ import annotations

from dataclasses import replace

from pagedserve.common.worker import WorkerConfig
from pagedserve.worker import WorkerActor


class PrefillWorkerActor(WorkerActor):
    def __init__(self, config: WorkerConfig, log_level: str = "INFO") -> None:
        super().__init__(replace(config, pool="prefill"), log_level)
