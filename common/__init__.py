"""What every role shares, in three layers (each checked by import-linter, see
pyproject.toml `[tool.importlinter]` and `make lint`):

- `api/`: torch-free plain data and rules that the router, the client and the engine
  all need (sampling parameters and their validation, request outputs and finish
  reasons, block hashing, the checkpoint's config, tokenizer loading, checkpoint
  lookup). Imports only the standard library and `transformers`' tokenizers.
- `core/`: the engine core (block manager, scheduler, engine, KV hand-off, model,
  attention kernels, sampler, loader, offline `LLM`). Imports `api/`, torch, triton,
  numpy, transformers, safetensors, gguf; never `runtime/`, a role, kvtransfer,
  grpc, ray, redis or prometheus_client.
- `runtime/`: the edges a worker process runs the core behind (gRPC worker server,
  Prometheus exporters, protobuf conversions, prefix-index clients, gRPC options).
  May import `api/`, `core/` and kvtransfer; never a role.

This package's own `__init__` imports nothing, so importing one layer never loads
another.
"""
