"""Torch-free definitions shared by the router, the client and the engine.

Owns: `sampling_params` (SamplingParams, InvalidRequestError, validate_prompt),
`outputs` (FinishReason, TokenLogprobs, SampleDelta, Usage, RequestOutput,
RequestError), `hashing` (block hashes), `limits` (ConfigError), `model_config`
(ModelSpec from a checkpoint's config.json), `tokenizer` (load_tokenizer,
encode_chat), `checkpoint` (finding a checkpoint dir, the default model's cache),
`settings` (every entry point's flags, derived from the config dataclasses).

May import: the standard library, `transformers` tokenizers (never torch at import
time; `tokenizer` and `model_config` name torch only for type checking),
`jsonargparse` (`settings` only: the client never imports it). Nothing else of
pagedserve.
"""
