"""The engine core: everything one process needs to run a model over a paged KV cache.

Owns: `block_manager`, `scheduler`, `engine` (LLMEngine: add / step / abort / stats),
`handoff` (the prefill/decode KV hand-off the servicers drive), `engine_loop` (the
engine on its own thread), `model`, `model_runner`, `kv_cache`, `attention/`,
`sampler`, `sequence`, `detokenizer`, `loader`, `config`, `llm` (offline use).

May import: `pagedserve.common.api`, torch, triton, numpy, transformers,
safetensors, gguf, the standard library. Never `pagedserve.common.runtime`, a role
(router, prefill_worker, decode_worker), kvtransfer, grpc, ray, redis or
prometheus_client (import-linter contract "engine core").
"""
