"""The router: the public gRPC server in front of the prefill and decode pools.

- `server.py`: `Router` (puts the parts below together; lifecycle, drain, health),
  `start_router_in_thread(config) -> RouterHandle`, `serve`
- `service.py`: the gRPC servicers (Generation with lenient parsing, Registry)
- `dispatch.py`: one request's path (checks, admission, route, Prefill, Decode,
  leases) with a per-request `RequestContext`
- `failures.py`: failure / refusal / final, the retry budget, the client's status
- `watch.py`: the Decode stream's progress bound (idle timeout, worker-left grace)
- `routing.py`: the routing decision (index lookup, policy ranking, disaggregate?)
- `channels.py`: one channel per worker, closed once its worker left
- `config.py`: `RouterConfig`
- `frontend.py`: tokenizing and validating a GenerateRequest
- `registry.py`: the worker registry (heartbeats, timeouts)
- `registry_feed.py`: Redis mode: the registry fed from the workers' stats in Redis
- `policy.py`: routing policies (`RoutingPolicy.rank`): prefix-aware (default),
  least-loaded, round-robin
- `prefix.py`: the prefix index as the router sees it (embedded or Redis; one match
  per request; load-only routing while it is unreachable)
- `cost.py`: transfer vs recompute estimate for cross-worker prefix pulls
- `admission.py`: bounded in-flight + queued requests
- `auth.py`: API keys -> tenants (UNAUTHENTICATED first), the tenant's cache salt,
  per-tenant concurrency limits
- `client.py`: a small sync client of the public API (used by the CLI)

May import: `pagedserve.common.api`, the torch-free modules of
`pagedserve.common.runtime` (`grpc_options`, `protocol`, `metrics_server`,
`prefix_index`), the generated stubs, grpc, redis, prometheus_client. Never the engine
core, a worker role, kvtransfer, or torch (import-linter contract "router and client";
tests/test_layers.py checks a fresh process): the router process and the client CLI
load no model code.
"""
