"""The Prometheus HTTP endpoint and the series-name prefix shared by the worker
exporter (`metrics.py`) and the router's (`router/metrics.py`).

A module of its own so that the router reaches the endpoint without the worker
exporter, whose snapshots name engine types.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

PREFIX = "pagedserve:"
# metrics_compat="vllm": the vLLM-named copies (same meaning, same labels).
VLLM_PREFIX = "vllm:"


class MetricsServer:
    """A metrics HTTP endpoint (prometheus_client's server) for one registry."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"metrics port must be in [0, 65535] (0 = any free), got {port}")
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port: int = self._httpd.server_address[1]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
