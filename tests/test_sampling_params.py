"""SamplingParams.validate and validate_prompt: every rule, with its exact message."""

import re

import pytest

from pagedserve.common.api.sampling_params import (
    InvalidRequestError,
    SamplingParams,
    validate_prompt,
)

VOCAB = 100

REJECTED = [
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0"),
    (dict(max_tokens=-5), "max_tokens must be at least 1, got -5"),
    (dict(max_tokens=2.5), "max_tokens must be an integer, got 2.5"),
    (dict(max_tokens=True), "max_tokens must be an integer, got True"),
    (dict(temperature=-0.1), "temperature must be >= 0 (0 means greedy), got -0.1"),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(temperature="hot"), "temperature must be a number, got 'hot'"),
    (dict(top_p=0.0), "top_p must be in (0, 1] (1 means off), got 0.0"),
    (dict(top_p=1.01), "top_p must be in (0, 1] (1 means off), got 1.01"),
    (dict(top_p=-0.5), "top_p must be in (0, 1] (1 means off), got -0.5"),
    (dict(top_k=-2), "top_k must be -1 or 0 (off) or a positive integer, got -2"),
    (dict(top_k=1.5), "top_k must be an integer, got 1.5"),
    (dict(min_p=-0.01), "min_p must be in [0, 1] (0 means off), got -0.01"),
    (dict(min_p=1.5), "min_p must be in [0, 1] (0 means off), got 1.5"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0 (1 means off), got 0.0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0 (1 means off), got -1.0"),
    (dict(seed="abc"), "seed must be an integer, got 'abc'"),
    (dict(n=0), "n must be between 1 and 16, got 0"),
    (dict(n=17), "n must be between 1 and 16, got 17"),
    (
        dict(n=2, temperature=0.0),
        "n must be 1 when temperature is 0 (greedy): all samples would be identical, got 2",
    ),
    (dict(stop=[""]), "stop[0] must not be empty, got ''"),
    (dict(stop=["ok", ""]), "stop[1] must not be empty, got ''"),
    (dict(stop=["ok", 3]), "stop[1] must be a string, got 3"),
    (dict(stop=5), "stop must be a string or a list of strings, got 5"),
    (dict(stop_token_ids=[-1]), "stop_token_ids[0] must be >= 0, got -1"),
    (
        dict(stop_token_ids=[2, VOCAB]),
        f"stop_token_ids[1] is outside the vocabulary [0, {VOCAB}), got {VOCAB}",
    ),
    (dict(stop_token_ids=["7"]), "stop_token_ids[0] must be an integer, got '7'"),
    (dict(logprobs=-1), "logprobs must be between 0 and 20, got -1"),
    (dict(logprobs=21), "logprobs must be between 0 and 20, got 21"),
    (dict(stop=["a"] * 17), "stop has 17 strings; at most 16 are allowed"),
    (dict(stop=["ok", "x" * 257]), "stop[1] has 257 characters; at most 256 are allowed"),
    (dict(stop_token_ids=[1] * 129), "stop_token_ids has 129 ids; at most 128 are allowed"),
    (dict(ignore_eos="yes"), "ignore_eos must be true or false, got 'yes'"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2] (0 means off), got 2.5"),
    (
        dict(frequency_penalty=-2.01),
        "frequency_penalty must be in [-2, 2] (0 means off), got -2.01",
    ),
    (dict(frequency_penalty=float("inf")), "frequency_penalty must be a finite number, got inf"),
    (dict(min_tokens=-1), "min_tokens must be in [0, max_tokens=16], got -1"),
    (dict(min_tokens=17), "min_tokens must be in [0, max_tokens=16], got 17"),
    (dict(min_tokens=1.5), "min_tokens must be an integer, got 1.5"),
]


@pytest.mark.parametrize(("fields", "message"), REJECTED)
def test_rejected_with_message(fields: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$"):
        SamplingParams(**fields).validate(vocab_size=VOCAB)


ACCEPTED = [
    dict(),
    dict(max_tokens=1),
    dict(temperature=0.0),
    dict(temperature=0, logprobs=0),
    dict(top_p=1.0),
    dict(top_p=1e-6),
    dict(top_k=-1),
    dict(top_k=0),
    dict(top_k=1),
    dict(top_k=10**9),  # larger than the vocabulary: acts as off
    dict(min_p=0.0),
    dict(min_p=1.0),
    dict(repetition_penalty=0.5),
    dict(seed=-3),
    dict(seed=2**70),
    dict(n=16, temperature=0.8),
    dict(stop=["\n\n", "###"], stop_token_ids=[0, VOCAB - 1]),
    dict(logprobs=0),
    dict(logprobs=20),
]


@pytest.mark.parametrize("fields", ACCEPTED)
def test_accepted(fields: dict) -> None:
    SamplingParams(**fields).validate(vocab_size=VOCAB)


def test_configured_limits() -> None:
    SamplingParams(n=4).validate(max_n=4)
    with pytest.raises(InvalidRequestError, match=r"^n must be between 1 and 3, got 4$"):
        SamplingParams(n=4).validate(max_n=3)
    with pytest.raises(InvalidRequestError, match=r"^logprobs must be between 0 and 5, got 6$"):
        SamplingParams(logprobs=6).validate(max_logprobs=5)
    with pytest.raises(
        InvalidRequestError, match=r"^logprobs must be at most the vocabulary size \(10\), got 15$"
    ):
        SamplingParams(logprobs=15).validate(vocab_size=10)
    SamplingParams(stop=["x" * 256] * 16, stop_token_ids=[1] * 128, logprobs=10).validate(
        vocab_size=10
    )
    # Without a vocabulary only the sign of stop token ids is checked.
    SamplingParams(stop_token_ids=[10**6]).validate()


def test_defaults_and_normalization() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.seed, p.stop, p.stop_token_ids) == (1.0, None, [], [])
    assert (p.ignore_eos, p.n, p.logprobs, p.greedy) == (False, 1, None, False)
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3,)).stop_token_ids == [3]
    # Defaults are not shared between instances.
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


def test_invalid_request_error_is_a_value_error() -> None:
    assert issubclass(InvalidRequestError, ValueError)


PROMPT_REJECTED = [
    ([], 8, "prompt is empty: give at least one token"),
    (
        list(range(12)),
        1,
        "prompt has 12 tokens, 2 more than max_model_len (10): shorten it",
    ),
    (
        list(range(8)),
        3,
        "prompt (8 tokens) + max_tokens (3) = 11 exceeds max_model_len (10) by 1: "
        "set max_tokens to at most 2",
    ),
    (
        list(range(10)),
        1,
        "prompt (10 tokens) + max_tokens (1) = 11 exceeds max_model_len (10) by 1: "
        "set max_tokens to at most 0",
    ),
    (
        [1, 2, VOCAB, -1],
        1,
        f"prompt token id {VOCAB} at index 2 is outside the vocabulary [0, {VOCAB})",
    ),
    ([5, -1], 1, f"prompt token id -1 at index 1 is outside the vocabulary [0, {VOCAB})"),
    ([5, "a"], 1, "prompt token at index 1 is 'a', not an integer token id"),
]


@pytest.mark.parametrize(("prompt", "max_tokens", "message"), PROMPT_REJECTED)
def test_prompt_rejected_with_message(prompt: list, max_tokens: int, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$"):
        validate_prompt(prompt, vocab_size=VOCAB, max_model_len=10, max_tokens=max_tokens)


def test_prompt_accepted_up_to_the_limit() -> None:
    validate_prompt([0, VOCAB - 1], vocab_size=VOCAB, max_model_len=10, max_tokens=8)
    validate_prompt(range(9), vocab_size=VOCAB, max_model_len=10, max_tokens=1)
    validate_prompt((7,), vocab_size=VOCAB, max_model_len=10, max_tokens=9)
