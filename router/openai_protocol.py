"""The OpenAI HTTP API's request bodies, and turning one into a GenerateRequest.

The models accept what the `openai` SDK and vLLM's clients send: the OpenAI fields,
plus vLLM's extra sampling fields where pagedserve has the same knob (`top_k`,
`min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`cache_salt`, and `return_token_ids`). Decisions:
- Unknown fields are ignored, as OpenAI and vLLM do (clients send fields of newer
  API versions); fields whose meaning pagedserve cannot honour (`logit_bias`, `echo`,
  `suffix`, `best_of` above `n`, tools, a JSON `response_format`) are refused 400
  naming the field, never silently dropped: the answer would not be what was asked.
- Every field left out is left unset in the GenerateRequest, so the server's
  defaults (generation.proto) apply; no default is restated here, except chat's
  max_tokens (below).
- Values are checked by the router's own checks (`SamplingParams.validate` via
  Dispatcher), not here, so HTTP and gRPC refuse the same requests with the same
  messages; pydantic only checks JSON types.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedserve.v1 import generation_pb2 as gen_pb


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted (OpenAI's abuse-monitoring id); not used
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    # vLLM's extra: each choice (and stream chunk) also carries its generated token ids
    return_token_ids: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported by this server", param="logit_bias")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # top logprobs per token (0: only the chosen token's)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (OpenAI allows a batch of them), in order."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError(400, "prompt is empty: give at least one character", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise OpenAIError(400, "echo is not supported by this server", param="echo")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise OpenAIError(
                400, "best_of other than n is not supported by this server", param="best_of"
            )


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None  # takes precedence over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise OpenAIError(400, "tools are not supported by this server", param="tools")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise OpenAIError(
                400,
                f"response_format {kind!r} is not supported by this server (only 'text')",
                param="response_format",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(
                400, "top_logprobs requires logprobs to be true", param="top_logprobs"
            )

    def turns(self) -> list[gen_pb.ChatMessage]:
        """The messages as plain-text turns; text parts are joined, others refused."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise OpenAIError(
                            400,
                            f"messages[{i}].content[{j}] has type {part.type!r}: only text "
                            "parts are supported",
                            param=f"messages[{i}].content",
                        )
                    texts.append(part.text)
                content = "".join(texts)
            out.append(gen_pb.ChatMessage(role=m.role, content=content or ""))
        return out


def _set_sampling(s: gen_pb.SamplingParams, body: _SamplingFields) -> None:
    """Copies every field the client gave onto the proto; unset fields stay unset."""
    for name in (
        "n",
        "temperature",
        "top_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "min_tokens",
    ):
        value = getattr(body, name)
        if value is not None:
            _assign(s, name, value)
    if body.stop is not None:
        s.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        _extend_ids(s.stop_token_ids, body.stop_token_ids, "stop_token_ids")


def _assign(msg: Any, name: str, value: Any) -> None:
    """setattr, with an out-of-range integer (seed 2**70) as a 400, not a 500."""
    try:
        setattr(msg, name, value)
    except (ValueError, TypeError) as e:
        raise OpenAIError(400, f"{name} {value!r} is out of range: {e}", param=name) from None


def _extend_ids(field: Any, ids: list[int], name: str) -> None:
    try:
        field.extend(ids)
    except (ValueError, TypeError):
        raise OpenAIError(
            400, f"{name} must be token ids in [0, 2^32), got {ids!r}", param=name
        ) from None


def completion_requests(body: CompletionRequest) -> list[gen_pb.GenerateRequest]:
    """One GenerateRequest per prompt of the batch (OpenAI numbers their choices
    prompt by prompt: choice index = prompt index * n + sample index)."""
    body.refuse_unsupported()
    out = []
    for prompt in body.prompts():
        req = gen_pb.GenerateRequest(cache_salt=body.cache_salt or "")
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            _extend_ids(req.prompt_token_ids.ids, prompt, "prompt")
            req.prompt_token_ids.SetInParent()
        req.sampling.SetInParent()
        _set_sampling(req.sampling, body)
        if body.max_tokens is not None:
            _assign(req.sampling, "max_tokens", body.max_tokens)
        if body.logprobs is not None:
            _assign(req.sampling, "logprobs", body.logprobs)
        out.append(req)
    return out


def chat_request(body: ChatCompletionRequest) -> gen_pb.GenerateRequest:
    """The chat request as a GenerateRequest; max_tokens left unset when the client
    gave none (the caller fills in the rest of the context, see openai_api)."""
    body.refuse_unsupported()
    req = gen_pb.GenerateRequest(cache_salt=body.cache_salt or "")
    req.messages.messages.extend(body.turns())
    req.messages.SetInParent()
    req.sampling.SetInParent()
    _set_sampling(req.sampling, body)
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if max_tokens is not None:
        _assign(req.sampling, "max_tokens", max_tokens)
    if body.logprobs:
        _assign(req.sampling, "logprobs", body.top_logprobs or 0)
    return req


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """A pydantic validation failure of the body as a 400 naming the first field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    return OpenAIError(400, f"{where}{first.get('msg', 'invalid value')}", param=param)


FINISH_REASONS: dict[int, str] = {
    gen_pb.FINISH_REASON_LENGTH: "length",
    gen_pb.FINISH_REASON_STOP: "stop",
    gen_pb.FINISH_REASON_EOS: "stop",
    gen_pb.FINISH_REASON_ABORT: "abort",  # vLLM's name for a sample the server ended
}
