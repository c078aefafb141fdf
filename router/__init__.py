"""The router: the public gRPC server in front of the prefill and decode pools.

- `server.py`: `Router`, `start_router_in_thread(config) -> RouterHandle`, `serve`
- `config.py`: `RouterConfig`
- `frontend.py`: tokenizing and validating a GenerateRequest
- `registry.py`: the embedded worker registry (heartbeats, timeouts)
- `policy.py`: routing policy (`RoutingPolicy.rank`; least loaded for now)
- `admission.py`: bounded in-flight + queued requests
- `client.py`: a small sync client of the public API (used by the CLI)
"""
