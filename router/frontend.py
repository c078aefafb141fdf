"""The router's view of the model: tokenizer + config, and turning a GenerateRequest
into the TokenizedRequest every worker receives.

The router never loads weights: it reads the checkpoint's config (ModelSpec) and
tokenizer, which is enough to tokenize, apply the chat template and validate a
request with the same checks the engine runs (`SamplingParams.validate`,
`validate_prompt`), so a bad request is refused before any worker sees it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import Message

from pagedserve.common.api.checkpoint import model_name, resolve_model_dir
from pagedserve.common.api.model_config import ModelSpec
from pagedserve.common.api.sampling_params import (
    InvalidRequestError,
    SamplingParams,
    validate_prompt,
)
from pagedserve.common.api.tokenizer import load_tokenizer
from pagedserve.common.runtime.protocol import sampling_from_pb
from pagedserve.router.auth import OPEN_TENANT, Tenant
from pagedserve.router.config import RouterConfig
from pagedserve.v1 import generation_pb2 as gen_pb
from pagedserve.v1 import worker_pb2

# What the sampling options of a valid request may take on the wire (stop strings and
# stop token ids, bounded by SamplingParams.validate; the rest are scalars).
SAMPLING_ALLOWANCE_BYTES = 1 << 20


@dataclass(frozen=True)
class ResolvedRequest:
    """A validated request, as token ids."""

    request_id: str
    prompt_token_ids: list[int]
    tokenized: worker_pb2.TokenizedRequest  # what the workers receive
    cache_salt: str | None  # the effective salt (Tenant.cache_salt), as the workers get it

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


class ModelFrontend:
    """Tokenizer, chat template and limits of the served model."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.model_name = model_name(config.model, self.model_dir)
        self.spec = ModelSpec.from_hf_config(
            json.loads((self.model_dir / "config.json").read_text())
        )
        self.tokenizer = load_tokenizer(self.model_dir)
        self.limits = config.limits.resolve(self.spec.max_model_len)
        self.max_model_len: int = self.limits.max_model_len  # type: ignore[assignment]
        self.eos_token_ids = self._eos_ids()

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def _eos_ids(self) -> list[int]:
        """The engine's EOS set: config, generation_config.json, and the tokenizer's.

        Mirrors `loader._with_generation_eos` + LLMEngine.__init__ (same order).
        """
        ids = list(self.spec.eos_token_ids)
        gen = Path(self.model_dir) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids += [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return list(dict.fromkeys(int(i) for i in ids))

    def model_info(self, block_size: int) -> gen_pb.ModelInfo:
        return gen_pb.ModelInfo(
            model_name=self.model_name,
            max_context_len=self.max_model_len,
            block_size=block_size,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            has_chat_template=self.has_chat_template,
        )

    # -- requests -----------------------------------------------------------------
    #
    # Split in two so that the router runs the cheap part on its event loop and the
    # expensive part (tokenizing, chat templating: O(prompt size)) on a thread:
    # `precheck` looks at sizes and fields only, `tokenize` does the rest. Every size
    # is bounded by `precheck` first, so the expensive part is bounded too.

    def resolve(
        self, request: gen_pb.GenerateRequest, tenant: Tenant = OPEN_TENANT
    ) -> ResolvedRequest:
        """Validates and tokenizes; raises InvalidRequestError naming what is wrong.

        (For tests and previews: the router's Generate path authenticates first and
        calls precheck and tokenize itself.)
        """
        rid, params = self.precheck(request)
        return self.tokenize(request, rid, params, tenant)

    def precheck(self, request: gen_pb.GenerateRequest) -> tuple[str, SamplingParams]:
        """Fields, sizes and sampling options, without tokenizing: (request id, params)."""
        check_known_fields(request)
        self.check_sizes(request)
        params = sampling_from_pb(request.sampling)
        params.validate(
            vocab_size=self.vocab_size,
            max_n=self.limits.max_n,
            max_logprobs=self.limits.max_logprobs,
        )
        rid = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
        if not rid:
            raise InvalidRequestError("request_id must not be empty (leave it unset instead)")
        return rid, params

    def check_sizes(self, request: gen_pb.GenerateRequest) -> None:
        """The input limits of RouterConfig; O(request size), no tokenizing.

        Token ids need no limit of their own: validate_prompt bounds them by
        max_model_len, and the message size bounds them before that.
        """
        c = self.config
        _check_bytes("request_id", request.request_id, c.max_request_id_bytes)
        _check_bytes("cache_salt", request.cache_salt, c.max_cache_salt_bytes)
        which = request.WhichOneof("input")
        if which == "prompt":
            _check_bytes("prompt", request.prompt, c.max_prompt_bytes)
        elif which == "messages":
            messages = request.messages.messages
            if len(messages) > c.max_messages:
                raise InvalidRequestError(
                    f"messages has {len(messages)} turns, more than the limit of "
                    f"{c.max_messages} (RouterConfig.max_messages)"
                )
            size = sum(len(m.role.encode()) + len(m.content.encode()) for m in messages)
            if size > c.max_prompt_bytes:
                raise InvalidRequestError(
                    f"messages hold {size} bytes of roles and contents (UTF-8), more than "
                    f"the limit of {c.max_prompt_bytes} (RouterConfig.max_prompt_bytes)"
                )

    def max_request_bytes(self) -> int:
        """The serialized size of the largest request the limits accept.

        The router's public server receives messages up to this size (larger ones are
        refused by gRPC with RESOURCE_EXHAUSTED before any of them is parsed): the
        largest of the three inputs, the id and salt with their framing, and an
        allowance for the sampling options (stop strings and stop ids are bounded
        by SamplingParams.validate; everything else there is a fixed-size scalar).
        """
        c = self.config
        token_ids = self.max_model_len * 5 + 16  # varint <= 5 bytes for a 32-bit id
        messages = c.max_prompt_bytes + c.max_messages * 16  # tags and length prefixes
        text = c.max_prompt_bytes + 16
        strings = c.max_request_id_bytes + c.max_cache_salt_bytes + 32
        return max(token_ids, messages, text) + strings + SAMPLING_ALLOWANCE_BYTES

    def tokenize(
        self, request: gen_pb.GenerateRequest, rid: str, params: SamplingParams, tenant: Tenant
    ) -> ResolvedRequest:
        """The prompt's token ids, checked against the model; runs off the event loop.

        The salt every later step uses (routing's block hashes, ExportPrefix, the
        workers' caches) is the tenant's combined with the client's, computed here once
        (Tenant.cache_salt): the client's `cache_salt` alone never reaches a worker.
        """
        ids = self.prompt_ids(request)
        validate_prompt(
            ids,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            max_tokens=params.max_tokens,
        )
        salt = tenant.cache_salt(request.cache_salt)
        tokenized = worker_pb2.TokenizedRequest(
            request_id=rid,
            prompt_token_ids=ids,
            sampling=request.sampling,
            cache_salt=salt or "",
        )
        return ResolvedRequest(rid, ids, tokenized, salt)

    def prompt_ids(self, request: gen_pb.GenerateRequest) -> list[int]:
        which = request.WhichOneof("input")
        if which is None:
            raise InvalidRequestError(
                "the request has no input: set exactly one of prompt, prompt_token_ids and messages"
            )
        if which == "prompt":
            if not request.prompt:
                raise InvalidRequestError("prompt is empty: give at least one character")
            return list(self.tokenizer(request.prompt).input_ids)
        if which == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        return self.chat_ids(request.messages.messages)

    def chat_ids(self, messages) -> list[int]:
        """The chat template + generation prompt, tokenized as LLMEngine.apply_chat_template."""
        if not self.has_chat_template:
            raise InvalidRequestError(
                f"model {self.model_name!r} has no chat template: send a prompt instead of messages"
            )
        if not messages:
            raise InvalidRequestError("messages is empty: give at least one chat turn")
        turns = []
        for i, m in enumerate(messages):
            if not m.role:
                raise InvalidRequestError(f"messages[{i}].role is empty (e.g. 'user')")
            turns.append({"role": m.role, "content": m.content})
        try:
            text = self.tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # jinja raises TemplateError (or raise_exception's own)
            raise InvalidRequestError(f"the chat template rejected the messages: {e}") from e
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


def _check_bytes(name: str, value: str, limit: int) -> None:
    # Cheap first: a str of n characters is at least n bytes in UTF-8, at most 4n.
    if len(value) * 4 <= limit:
        return
    size = len(value.encode())
    if size > limit:
        field = "max_prompt_bytes" if name == "prompt" else f"max_{name}_bytes"
        raise InvalidRequestError(
            f"{name} is {size} bytes (UTF-8), more than the limit of {limit} (RouterConfig.{field})"
        )


def check_known_fields(msg: Message, path: str = "") -> None:
    """Refuses fields and enum values this server does not know.

    proto3 keeps unknown fields (a newer client's option) and unknown enum numbers
    silently; acting as if they were absent would change the request's meaning, so
    they are INVALID_ARGUMENT here, with the field's path.
    """
    name = path or msg.DESCRIPTOR.name
    unknown = _unknown_field_numbers(msg)
    if unknown:
        raise InvalidRequestError(
            f"{name} has unknown field number(s) {unknown}: this server does not support them"
        )
    for fd, value in msg.ListFields():
        sub = f"{path}.{fd.name}" if path else fd.name
        values = value if _is_repeated(fd) else [value]
        if fd.message_type is not None:
            if fd.message_type.GetOptions().map_entry:
                continue
            for i, v in enumerate(values):
                check_known_fields(v, f"{sub}[{i}]" if _is_repeated(fd) else sub)
        elif fd.enum_type is not None:
            for v in values:
                if v not in fd.enum_type.values_by_number:
                    known = ", ".join(e.name for e in fd.enum_type.values)
                    raise InvalidRequestError(
                        f"{sub} has unknown value {v}: expected one of {known}"
                    )


def _is_repeated(fd) -> bool:
    return bool(fd.is_repeated)


def _unknown_field_numbers(msg: Message) -> list[int]:
    from google.protobuf import unknown_fields

    return sorted({f.field_number for f in unknown_fields.UnknownFieldSet(msg)})
