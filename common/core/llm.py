"""The offline API: `LLM(...).generate(...)`, usable from a notebook.

No Ray, Redis or gRPC: one engine in this process, driven step by step.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

from pagedserve.common.api.outputs import (
    Completion,
    RequestError,
    RequestOutput,
    Usage,
)
from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.common.core.engine import LLMEngine
from pagedserve.common.core.sequence import Request

Prompt = str | Seq[int]


@dataclass
class GenerateResult:
    """One prompt's outcome. `error` is set when its request failed on its own (its
    parameters, or a fault while serving it: `error.kind`, `error.message`); its
    completions then hold what was generated before (finish reason ABORT), and every
    other prompt of the call is unaffected."""

    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    usage: Usage | None = None
    error: RequestError | None = None

    def raise_for_error(self) -> GenerateResult:
        """Returns self; raises `RequestFailedError` when this prompt's request failed."""
        if self.error is not None:
            raise RequestFailedError(self.request_id, self.error)
        return self


class RequestFailedError(RuntimeError):
    """One prompt's request failed on its own (see GenerateResult.error)."""

    def __init__(self, request_id: str, error: RequestError) -> None:
        super().__init__(f"request {request_id} failed ({error.kind.value}): {error.message}")
        self.request_id = request_id
        self.error = error


class LLM:
    """
    >>> llm = LLM(dtype="bfloat16")                       # the default model
    >>> llm.generate("The capital of France is", SamplingParams(temperature=0))
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        config: EngineConfig | None = None,
        **engine_kwargs: object,
    ) -> None:
        if config is None:
            config = EngineConfig(
                model=model,
                dtype=dtype,  # type: ignore[arg-type]
                cache=CacheConfig(
                    block_size=block_size,
                    num_blocks=num_blocks,
                    enable_prefix_caching=enable_prefix_caching,
                    preemption_mode=preemption_mode,  # type: ignore[arg-type]
                ),
                scheduler=SchedulerConfig(
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                    max_model_len=max_model_len,
                    max_num_waiting_seqs=None,  # every prompt is submitted at once
                ),
            )
            config = replace(config, **engine_kwargs)  # type: ignore[arg-type]
        self.engine = LLMEngine(config)
        self._counter = 0

    def stream(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Submits every prompt at once and yields per-request deltas as steps finish."""
        pending = set(self._submit(prompts, params))
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
        finally:
            for rid in pending:  # the caller stopped iterating: free what is left
                self.engine.abort_request(rid)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[GenerateResult]:
        """Runs every prompt to completion (continuous batching); results in input order.

        A prompt whose request fails on its own does not raise here (the others would be
        lost): its result has `error` set; `result.raise_for_error()` raises it."""
        results: dict[str, GenerateResult] = {}
        for out in self.stream(prompts, params):
            if out.request_id not in results:
                prompt_ids = self._submitted[out.request_id].prompt_token_ids
                results[out.request_id] = GenerateResult(out.request_id, prompt_ids, [])
            res = results[out.request_id]
            for delta in out.samples:
                while len(res.completions) <= delta.index:
                    res.completions.append(Completion(index=len(res.completions)))
                c = res.completions[delta.index]
                c.text += delta.text
                c.token_ids += delta.token_ids
                c.logprobs += delta.logprobs
                if delta.finish_reason is not None:
                    c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
            if out.usage is not None:
                res.usage = out.usage
            if out.error is not None:
                res.error = out.error
        return [results[rid] for rid in self._submitted if rid in results]

    def _submit(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None,
    ) -> list[str]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError("give one SamplingParams, or one per prompt")
        # Insertion order of this dict is the input order of the results.
        self._submitted: dict[str, Request] = {}
        try:
            for prompt, p in zip(prompt_list, param_list, strict=True):
                self._counter += 1
                rid = f"llm-{self._counter}"
                if isinstance(prompt, str):
                    req = self.engine.add_request(rid, prompt, p)
                else:
                    req = self.engine.add_request(rid, prompt_token_ids=list(prompt), params=p)
                self._submitted[rid] = req
        except Exception:
            for rid in self._submitted:  # all or nothing: a bad prompt submits none
                self.engine.abort_request(rid)
            raise
        return list(self._submitted)
