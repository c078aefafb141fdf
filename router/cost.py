"""What moving KV blocks costs against computing them: the router's estimate.

    transfer_s(T tokens) = overhead_s + T * kv_bytes_per_token / transfer_bytes_per_s
    compute_s(T tokens)  = T / prefill_tokens_per_s

- `kv_bytes_per_token` starts from the model's config (K and V of every layer in
  fp32, the CPU default) and is replaced by the exact size from the layout of the
  first KV handle the router sees (every Prefill and ExportPrefix answer has one).
- `overhead_s` starts at the configured `transfer_overhead_s` and then is the
  lowest ExportPrefix latency among the last `EXPORT_WINDOW` the router measured:
  the fixed cost of a pull it can see (an RPC, pinning and staging the blocks on the
  holder). The minimum, not a mean: an export also waits for the holder's current
  engine step, and on a busy CPU one slow export would otherwise price pulls out
  for good (no pull, no new measurement) although most are quick.
- `transfer_bytes_per_s` and `prefill_tokens_per_s` are configured (PrefixRouting):
  the router does not see how long a pull or a prefill took on the worker.
"""

from __future__ import annotations

import logging
from collections import deque

from pagedserve.router.config import PrefixRouting

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
EXPORT_WINDOW = 32  # ExportPrefix latencies remembered


class TransferEstimator:
    def __init__(self, config: PrefixRouting, kv_bytes_per_token: float = 0.0) -> None:
        self.config = config
        self.kv_bytes_per_token = float(kv_bytes_per_token)
        self.overhead_s = config.transfer_overhead_s
        self.exports_measured = 0
        self._exports: deque[float] = deque(maxlen=EXPORT_WINDOW)
        self._exact = False  # kv_bytes_per_token came from a handle's layout

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
        self._exports.append(seconds)
        self.overhead_s = min(self._exports)
        self.exports_measured += 1
