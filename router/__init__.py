"""The router: the public gRPC server in front of the prefill and decode pools.

- `server.py`: `Router`, `start_router_in_thread(config) -> RouterHandle`, `serve`
- `config.py`: `RouterConfig`
- `frontend.py`: tokenizing and validating a GenerateRequest
- `registry.py`: the worker registry (heartbeats, timeouts; fed from Redis in Redis mode)
- `policy.py`: routing policies (`RoutingPolicy.rank`): prefix-aware (default),
  least-loaded, round-robin
- `prefix.py`: the prefix index as the router sees it (embedded or Redis; one match
  per request; load-only routing while it is unreachable)
- `cost.py`: transfer vs recompute estimate for cross-worker prefix pulls
- `admission.py`: bounded in-flight + queued requests
- `client.py`: a small sync client of the public API (used by the CLI)

May import: `pagedserve.common.api`, the torch-free modules of
`pagedserve.common.runtime` (`grpc_options`, `protocol`, `metrics_server`,
`prefix_index`), the generated stubs, grpc, redis, prometheus_client. Never the engine
core, a worker role, kvtransfer, or torch (import-linter contract "router and client";
tests/test_layers.py checks a fresh process): the router process and the client CLI
load no model code.
"""
