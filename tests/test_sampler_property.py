"""Property test: the sampler over every value `SamplingParams.validate` admits.

Random batches of rows, each with its own parameters (extreme but finite temperatures,
top-p, top-k beyond the vocabulary, min-p, repetition penalties, logprobs, seeds) and
its own logits (ties, -inf, NaN, +inf, huge magnitudes; float32 and bfloat16). For every
batch: no exception; every token inside the vocabulary; a token that had no probability
(-inf or NaN logit) is never drawn while the row holds a possible one; logprobs are
never NaN; and a greedy row, or a seeded row, gets the same token alone as in the batch
(its neighbours never change it).

The values that used to crash (index V out of bounds from the inverse-CDF search) are
pinned as explicit examples: a tiny temperature or a tiny repetition penalty with
large logits made (l / T) overflow to inf, and inf - inf = NaN weights.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core import sampler as sampler_module
from pagedserve.common.core.sampler import Sampler, make_generator

VOCAB = 12
sampler = Sampler()

_SPECIAL = [0.0, 1.0, -1.0, 2.5, math.inf, -math.inf, math.nan, 3e38, -3e38, 1e30, -1e30, 1e-30]
logit_values = st.one_of(st.sampled_from(_SPECIAL), st.floats(-1e4, 1e4, allow_nan=False, width=32))
rows = st.lists(logit_values, min_size=VOCAB, max_size=VOCAB)

temperatures = st.one_of(
    st.sampled_from([0.0, 1e-300, 1e-45, 1e-30, 1e-8, 0.01, 0.7, 1.0, 2.0, 1e6, 1e30, 1e300]),
    st.floats(0.0, 1.7e308, allow_nan=False),
)
top_ps = st.one_of(
    st.sampled_from([1e-300, 1e-30, 1e-7, 0.3, 0.9, 0.999999, 1.0]),
    st.floats(0.0, 1.0, exclude_min=True),
)
top_ks = st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 10**9])
min_ps = st.one_of(
    st.sampled_from([0.0, 1e-300, 1e-30, 0.1, 0.5, 0.999999, 1.0]), st.floats(0.0, 1.0)
)
penalties = st.one_of(
    st.sampled_from([1.0, 1e-300, 1e-30, 0.5, 2.0, 1e30, 1e300]),
    st.floats(0.0, 1.7e308, exclude_min=True),
)
params_st = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_p=top_ps,
    top_k=top_ks,
    min_p=min_ps,
    repetition_penalty=penalties,
    logprobs=st.one_of(st.none(), st.integers(0, VOCAB)),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
)
histories = st.lists(st.integers(0, VOCAB - 1), max_size=6)
row_specs = st.tuples(rows, params_st, histories, histories)


def _sample(logits, params, seeds_or_gens, outputs, prompts):
    return sampler(logits, params, seeds_or_gens, outputs, prompts)


def _generators(params: list[SamplingParams]) -> list[torch.Generator | None]:
    return [make_generator(p.seed) for p in params]


def _possible(raw: list[float]) -> set[int]:
    """Tokens a row may draw: its +inf tokens if it has any, else its finite ones, else
    (no possible token at all) every token. A penalty <= 1 may turn a finite logit into
    +inf (still in the set), never into -inf, so the set holds for such rows too."""
    finite = {i for i, x in enumerate(raw) if math.isfinite(x)}
    posinf = {i for i, x in enumerate(raw) if x == math.inf}
    return (posinf | finite) or set(range(len(raw)))


def _check_batch(specs, dtype: torch.dtype) -> None:
    raws = [s[0] for s in specs]
    params = [s[1] for s in specs]
    outputs = [s[2] for s in specs]
    prompts = [s[3] for s in specs]
    for p in params:
        p.validate(vocab_size=VOCAB)  # only values the validator admits
    logits = torch.tensor(raws, dtype=torch.float32).to(dtype)  # [N, V]
    before = logits.clone()
    gens = _generators(params)
    out = _sample(logits, params, gens, outputs, prompts)

    assert torch.equal(logits.isnan(), before.isnan())
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())  # never modified
    assert len(out.token_ids) == len(specs) == len(out.logprobs)
    as_sampled = logits.float().tolist()  # what the sampler saw (bf16 rounds)
    for i, (token, p) in enumerate(zip(out.token_ids, params, strict=True)):
        assert 0 <= token < VOCAB
        if p.repetition_penalty <= 1.0:  # a penalty > 1 may overflow a row to all -inf
            assert token in _possible(as_sampled[i])
        if p.repetition_penalty == 1.0 and math.inf in as_sampled[i]:
            assert as_sampled[i][token] == math.inf
        lp = out.logprobs[i]
        if p.logprobs is None:
            assert lp is None
        else:
            assert lp is not None and lp.token_id == token
            assert len(lp.top) == min(p.logprobs, VOCAB)
            values = [lp.logprob] + [v for _, v in lp.top]
            assert not any(math.isnan(v) for v in values)
            assert all(v <= 1e-4 for v in values)
            assert all(0 <= t < VOCAB for t, _ in lp.top)
        if p.greedy or p.seed is not None:
            # alone, with a fresh generator of the same seed: the same token
            alone = _sample(logits[i : i + 1], [p], _generators([p]), [outputs[i]], [prompts[i]])
            assert alone.token_ids == [token], f"row {i} changed by its neighbours"


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    specs=st.lists(row_specs, min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
@example(  # used to crash: 1e-30 temperature over large logits -> inf - inf
    specs=[([1e30] + [0.0] * (VOCAB - 1), SamplingParams(temperature=1e-30), [], [])],
    dtype=torch.float32,
)
@example(  # used to crash: tiny penalty then tiny temperature, top-k path
    specs=[
        (
            [3.0, 1.0] + [0.5] * (VOCAB - 2),
            SamplingParams(temperature=1e-30, top_k=3, repetition_penalty=1e-30),
            [],
            [0],
        ),
        ([0.0] * VOCAB, SamplingParams(temperature=0), [], []),
    ],
    dtype=torch.bfloat16,
)
@example(  # top_p that rounds to 0 in float32 must still keep the top token
    specs=[([1.0, 2.0] + [0.0] * (VOCAB - 2), SamplingParams(top_p=1e-300), [], [])],
    dtype=torch.float32,
)
@example(  # a temperature that rounds to 0 / to inf in float32
    specs=[
        ([1.0, 2.0] + [-math.inf] * (VOCAB - 2), SamplingParams(temperature=1e-300), [], []),
        ([1.0, 2.0] + [-math.inf] * (VOCAB - 2), SamplingParams(temperature=1e300), [], []),
    ],
    dtype=torch.float32,
)
@example(  # rows with no finite logit, and NaN next to a greedy neighbour
    specs=[
        ([-math.inf] * VOCAB, SamplingParams(temperature=0.5, logprobs=3), [], []),
        ([math.nan] * VOCAB, SamplingParams(temperature=0, logprobs=VOCAB), [], []),
        ([math.nan, 1.0] + [0.0] * (VOCAB - 2), SamplingParams(temperature=0), [], []),
    ],
    dtype=torch.float32,
)
def test_sampler_is_total_and_greedy_rows_ignore_neighbours(specs, dtype) -> None:
    _check_batch(specs, dtype)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(row_specs, min_size=1, max_size=4))
def test_top_p_candidate_levels_stay_safe(specs) -> None:
    """The top-p candidate levels (top 256, top 4096, full sort) shrunk to fit VOCAB, so
    the partial-normalization and fallback paths run on these rows too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler_module, "_TOP_P_CANDIDATES", (2, 5))
        _check_batch(specs, torch.float32)
