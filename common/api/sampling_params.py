"""Per-request sampling parameters and the checks that reject bad requests.

Every check runs before the engine takes a single KV block, so a rejected request
costs nothing. Each failure raises `InvalidRequestError` with a message that names
the field, the value received and what is allowed; the cluster's edge maps it to gRPC
`INVALID_ARGUMENT` (HTTP 400).

Decisions:
- `temperature == 0` means greedy (argmax); there is no separate flag.
- `top_k` of -1 or 0 means off; a `top_k` larger than the vocabulary is allowed and
  acts as off (clients send large values meaning "no limit").
- `n > 1` with greedy sampling is rejected: the n samples would be identical.
- `stop` may be given as one string (as the OpenAI API allows); it is stored as a list.
- The prompt plus `max_tokens` must fit in `max_model_len` (the last generated token
  needs no KV slot, but every token before it does, and the client asked for all of
  them): a request that could not finish is rejected up front instead of being cut.
- No floor or ceiling on temperature or repetition_penalty beyond "finite": the sampler
  is exact for every positive finite value (it scales l - max, never a raw logit, and
  clamps into float32's normal range; see common/core/sampler.py). A tiny temperature
  (1e-30) samples among the exact ties of the top logit, the limit of the distribution,
  which is what a client asking for "almost greedy" wants; treating it as greedy would
  change how seeds and `n` behave, and rejecting it would break such clients. Likewise
  a huge temperature is uniform over the tokens top-k/top-p/min-p keep. Every admitted
  combination is exercised by tests/test_sampler_property.py.
- Limits that keep one request's per-token work small (every stop string is searched
  for, and held text kept, on every token; stop token ids are checked on every token):
  at most MAX_STOP_STRINGS stop strings of at most MAX_STOP_STRING_CHARS characters,
  at most MAX_STOP_TOKEN_IDS stop token ids. `logprobs` is at most the engine's
  `max_logprobs` and at most the vocabulary size.
- `presence_penalty` / `frequency_penalty` have OpenAI's meaning and range [-2, 2]:
  logit -= frequency_penalty * count + presence_penalty * (count > 0), where count is
  how often the token occurs in this sample's *generated* tokens (never the prompt,
  unlike `repetition_penalty`). Applied after the repetition penalty, before
  temperature.
- `min_tokens`: EOS tokens (unless `ignore_eos`) and `stop_token_ids` are masked until
  that many tokens were generated, and stop *strings* are looked for only in the text
  that comes after, as vLLM does. At most `max_tokens`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 128


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message says which field and what is allowed."""


@dataclass
class SamplingParams:
    """How to pick each next token of one request, and when to stop."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off (HF semantics)
    seed: int | None = None  # per-request RNG seed; None = the engine's global RNG
    stop: list[str] = field(default_factory=list)  # matched on the text, excluded from it
    stop_token_ids: list[int] = field(default_factory=list)  # kept in the token ids
    ignore_eos: bool = False
    n: int = 1  # parallel samples of the same prompt
    logprobs: int | None = None  # top logprobs per token; 0 = only the chosen token's
    presence_penalty: float = 0.0  # in [-2, 2]; 0 = off (OpenAI semantics, output only)
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 = off (OpenAI semantics, output only)
    min_tokens: int = 0  # EOS and stop token ids masked until this many were generated

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(
        self, *, vocab_size: int | None = None, max_n: int = 16, max_logprobs: int = 20
    ) -> None:
        """Raise `InvalidRequestError` naming the first field that is out of range."""
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "must be at least 1")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            _fail("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "must be in (0, 1] (1 means off)")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            _fail("top_k", self.top_k, "must be -1 or 0 (off) or a positive integer")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "must be in [0, 1] (0 means off)")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "must be > 0 (1 means off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2 <= value <= 2:
                _fail(name, value, "must be in [-2, 2] (0 means off)")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be in [0, max_tokens={self.max_tokens}]")
        if self.seed is not None:
            _check_int("seed", self.seed)
        self._validate_n(max_n)
        self._validate_stops(vocab_size)
        self._validate_logprobs(max_logprobs, vocab_size)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "must be true or false")

    def _validate_n(self, max_n: int) -> None:
        _check_int("n", self.n)
        if not 1 <= self.n <= max_n:
            _fail("n", self.n, f"must be between 1 and {max_n}")
        if self.n > 1 and self.greedy:
            _fail(
                "n",
                self.n,
                "must be 1 when temperature is 0 (greedy): all samples would be identical",
            )

    def _validate_stops(self, vocab_size: int | None) -> None:
        if not isinstance(self.stop, list):
            _fail("stop", self.stop, "must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail_count("stop", len(self.stop), "strings", MAX_STOP_STRINGS)
        for i, s in enumerate(self.stop):
            if not isinstance(s, str):
                _fail(f"stop[{i}]", s, "must be a string")
            if not s:
                _fail(f"stop[{i}]", s, "must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                _fail_count(f"stop[{i}]", len(s), "characters", MAX_STOP_STRING_CHARS)
        if not isinstance(self.stop_token_ids, list):
            _fail("stop_token_ids", self.stop_token_ids, "must be a list of token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail_count("stop_token_ids", len(self.stop_token_ids), "ids", MAX_STOP_TOKEN_IDS)
        for i, t in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", t)
            if t < 0:
                _fail(f"stop_token_ids[{i}]", t, "must be >= 0")
            if vocab_size is not None and t >= vocab_size:
                _fail(f"stop_token_ids[{i}]", t, f"is outside the vocabulary [0, {vocab_size})")

    def _validate_logprobs(self, max_logprobs: int, vocab_size: int | None) -> None:
        if self.logprobs is None:
            return
        _check_int("logprobs", self.logprobs)
        if not 0 <= self.logprobs <= max_logprobs:
            _fail("logprobs", self.logprobs, f"must be between 0 and {max_logprobs}")
        if vocab_size is not None and self.logprobs > vocab_size:
            _fail("logprobs", self.logprobs, f"must be at most the vocabulary size ({vocab_size})")


def validate_prompt(
    token_ids: Sequence[int], *, vocab_size: int, max_model_len: int, max_tokens: int
) -> None:
    """Reject an empty prompt, one too long for the model, or one with unknown token ids."""
    n = len(token_ids)
    if n == 0:
        raise InvalidRequestError("prompt is empty: give at least one token")
    if n > max_model_len:
        raise InvalidRequestError(
            f"prompt has {n} tokens, {n - max_model_len} more than max_model_len "
            f"({max_model_len}): shorten it"
        )
    if n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
            f"max_model_len ({max_model_len}) by {n + max_tokens - max_model_len}: "
            f"set max_tokens to at most {max_model_len - n}"
        )
    for i, t in enumerate(token_ids):
        try:
            t = operator.index(t)
        except TypeError:
            raise InvalidRequestError(
                f"prompt token at index {i} is {t!r}, not an integer token id"
            ) from None
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"prompt token id {t} at index {i} is outside the vocabulary [0, {vocab_size})"
            )


def _fail(name: str, value: object, rule: str) -> None:
    raise InvalidRequestError(f"{name} {rule}, got {value!r}")


def _fail_count(name: str, count: int, unit: str, limit: int) -> None:
    raise InvalidRequestError(f"{name} has {count} {unit}; at most {limit} are allowed")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, "must be an integer")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, value, "must be a number")
    if not math.isfinite(value):  # type: ignore[arg-type]
        _fail(name, value, "must be a finite number")
