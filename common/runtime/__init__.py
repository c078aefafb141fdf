"""The runtime edges a worker (and, for some modules, the router) runs on.

Owns: `worker` (WorkerRuntime: the worker's gRPC server, health, KV source and
transports, heartbeats), `metrics` (a worker's Prometheus exporter),
`metrics_server` (the HTTP endpoint and name prefix, shared with the router),
`protocol` (the one place protobuf <-> api/engine conversions live), `grpc_options`
(plain constants), `leases` (the one ReleaseLease call and the workers' releaser),
`servicer_support` (what both roles' servicers share), `prefix_index/` (the global
prefix-hash index: embedded, Redis, over gRPC; the worker registry in Redis), `tls`
(TLS and mutual TLS credentials from certificate files).

May import: `pagedserve.common.api`, `pagedserve.common.core`, kvtransfer, the
generated stubs, grpc, redis, prometheus_client. Never a role. The router imports
only the torch-free modules here (`grpc_options`, `protocol`, `metrics_server`,
`leases`, `prefix_index`, `tls`): import-linter checks that none of them reaches the
core.
"""
