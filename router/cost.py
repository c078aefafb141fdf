"""What moving KV blocks costs against computing them: the router's estimate.

    transfer_s(T tokens) = overhead_s + T * kv_bytes_per_token / transfer_bytes_per_s
    compute_s(T tokens)  = T / prefill_tokens_per_s

- `kv_bytes_per_token` starts from the model's config (K and V of every layer in
  fp32, the CPU default) and is replaced by the exact size from the layout of the
  first KV handle the router sees (every Prefill and ExportPrefix answer has one).
- `overhead_s` is the median ExportPrefix latency the router measured in the last
  `EXPORT_WINDOW_S` seconds (at most `EXPORT_SAMPLES` of them), else the configured
  `transfer_overhead_s`: the part of a pull's cost the router can see (an RPC,
  pinning and staging the blocks on the holder, which waits for the holder's current
  engine step). The median, so one slow export does not price pulls out; a window
  in time, so that when exports were too slow to be worth it (no pull, so no new
  measurement) the configured value comes back and pulls are tried again.
- `transfer_bytes_per_s` and `prefill_tokens_per_s` are configured (PrefixRouting):
  the router does not see how long a pull or a prefill took on the worker.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

from pagedserve.router.config import PrefixRouting

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
EXPORT_WINDOW_S = 30.0  # how long an ExportPrefix latency counts
EXPORT_SAMPLES = 32  # at most this many of them


class TransferEstimator:
    def __init__(
        self,
        config: PrefixRouting,
        kv_bytes_per_token: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv_bytes_per_token = float(kv_bytes_per_token)
        self.clock = clock
        self.exports_measured = 0
        self._exports: deque[tuple[float, float]] = deque(maxlen=EXPORT_SAMPLES)  # (when, s)
        self._exact = False  # kv_bytes_per_token came from a handle's layout

    @property
    def overhead_s(self) -> float:
        """The fixed cost of one pull, in seconds (see the module docstring)."""
        horizon = self.clock() - EXPORT_WINDOW_S
        while self._exports and self._exports[0][0] < horizon:
            self._exports.popleft()
        if not self._exports:
            return self.config.transfer_overhead_s
        return statistics.median(s for _, s in self._exports)

    def transfer_s(self, num_tokens: int) -> float:
        """Estimated seconds to pull the KV of `num_tokens` tokens from another worker."""
        return (
            self.overhead_s
            + num_tokens * self.kv_bytes_per_token / self.config.transfer_bytes_per_s
        )

    def compute_s(self, num_tokens: int) -> float:
        """Estimated seconds to prefill `num_tokens` prompt tokens instead."""
        return num_tokens / self.config.prefill_tokens_per_s

    def set_model(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 4):
        """An estimate from the model's shape, until a handle tells the exact layout."""
        if not self._exact:
            self.kv_bytes_per_token = float(2 * num_layers * num_kv_heads * head_dim * dtype_bytes)

    def observe_layout(self, layout) -> None:
        """The exact KV size per token, from a KVHandle's KVLayout."""
        if not layout.num_layers:
            return
        size = (
            2
            * layout.num_layers
            * layout.num_kv_heads
            * layout.head_dim
            * DTYPE_BYTES.get(layout.dtype, 4)
        )
        if not self._exact or size != self.kv_bytes_per_token:
            logger.info("KV size per token: %d bytes (from a handle's layout)", size)
        self.kv_bytes_per_token = float(size)
        self._exact = True

    def observe_export(self, seconds: float) -> None:
        """One measured ExportPrefix round trip."""
        self._exports.append((self.clock(), seconds))
        self.exports_measured += 1
