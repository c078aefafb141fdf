"""Sampler: greedy, seeds, the top-k / top-p / min-p masks, repetition penalty, logprobs.

Masks are checked by their support: many draws from hand-built logits with a seeded
generator, and the set of tokens that ever came out must be exactly the kept set.
"""

import math

import pytest
import torch

from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core import sampler as sampler_module
from pagedserve.common.core.sampler import SampleOutput, Sampler, make_generator

sampler = Sampler()


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list | None = None,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
) -> SampleOutput:
    n = logits.shape[0]
    return sampler(
        logits,
        params,
        generators if generators is not None else [None] * n,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
    )


def log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def support(logits_row: torch.Tensor, params: SamplingParams, draws: int = 600) -> set[int]:
    """Tokens drawn from one row, `draws` times, with one seeded generator."""
    g = make_generator(1234)
    logits = logits_row.expand(draws, -1).contiguous()  # [draws, V]
    out = run(logits, [params] * draws, [g] * draws)
    return set(out.token_ids)


def random_logits(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3


# --- greedy -------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = random_logits(64, 1000)
    out = run(logits, [SamplingParams(temperature=0)] * 64)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 64


def test_batched_greedy_fast_path_equals_per_row_path() -> None:
    logits = random_logits(16, 500, seed=1)
    greedy = SamplingParams(temperature=0)
    fast = run(logits, [greedy] * 16).token_ids
    # logprobs=0 forces the general path for the whole batch; one row at a time too.
    general = run(logits, [SamplingParams(temperature=0, logprobs=0)] * 16).token_ids
    per_row = [run(logits[i : i + 1], [greedy]).token_ids[0] for i in range(16)]
    assert fast == general == per_row == logits.argmax(dim=-1).tolist()


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(8, 300, seed=2)
    gens = [make_generator(s) for s in range(8)]
    for _ in range(20):
        out = run(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8, gens)
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_in_a_mixed_batch_stay_argmax() -> None:
    logits = random_logits(6, 200, seed=3)
    params = [SamplingParams(temperature=0) if i % 2 == 0 else SamplingParams() for i in range(6)]
    gens = [None if i % 2 == 0 else make_generator(i) for i in range(6)]
    out = run(logits, params, gens)
    assert out.token_ids[0::2] == logits[0::2].argmax(dim=-1).tolist()


def test_logits_are_not_modified() -> None:
    logits = random_logits(4, 50, seed=4)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)] * 2 + [
        SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=2)
    ] * 2
    run(logits, params, outputs=[[1, 2]] * 4, prompts=[[3]] * 4)
    assert torch.equal(logits, before)


# --- seeds --------------------------------------------------------------------------


def draw_sequence(seed: int | None, sample_index: int = 0, steps: int = 30) -> list[int]:
    """One sequence of tokens drawn over `steps` fixed random logits rows."""
    logits = random_logits(steps, 64, seed=5)  # flat enough that draws vary
    g = make_generator(seed, sample_index)
    return [run(logits[t : t + 1], [SamplingParams()], [g]).token_ids[0] for t in range(steps)]


def test_fixed_seed_reproduces_tokens_and_different_seeds_differ() -> None:
    assert draw_sequence(7) == draw_sequence(7)
    assert draw_sequence(7) != draw_sequence(8)
    assert draw_sequence(7, sample_index=1) == draw_sequence(7, sample_index=1)
    assert draw_sequence(7, sample_index=1) != draw_sequence(7, sample_index=0)
    # Sample 1 of seed 7 is not sample 0 of seed 8 (no "seed + index" aliasing).
    assert draw_sequence(7, sample_index=1) != draw_sequence(8, sample_index=0)


def test_make_generator() -> None:
    assert make_generator(None, 3) is None
    a, b = make_generator(5, 0), make_generator(5, 0)
    assert torch.equal(a.get_state(), b.get_state())
    assert not torch.equal(a.get_state(), make_generator(5, 1).get_state())
    assert make_generator(2**70, 0) is not None and make_generator(-1, 0) is not None


def test_seeded_row_does_not_depend_on_its_batch() -> None:
    """A seeded request draws the same tokens alone or next to other requests."""
    logits = random_logits(5, 64, seed=6)
    alone_gen = make_generator(99)
    alone = [run(logits[2:3], [SamplingParams()], [alone_gen]).token_ids[0] for _ in range(10)]
    gens = [None, make_generator(1), make_generator(99), None, make_generator(3)]
    params = [SamplingParams(), SamplingParams(top_k=3), SamplingParams()] + [
        SamplingParams(temperature=0),
        SamplingParams(min_p=0.2),
    ]
    batched = [run(logits, params, gens).token_ids[2] for _ in range(10)]
    assert batched == alone
    assert len(set(alone)) > 1  # the test draws, it does not just take the argmax


def test_draw_frequencies_match_the_distribution() -> None:
    """The exponential race is a draw from softmax(logits / temperature)."""
    probs = [0.5, 0.3, 0.15, 0.05]
    draws = 20000
    torch.manual_seed(0)  # unseeded rows use the global RNG
    logits = log_probs(probs).expand(draws, -1).contiguous()
    out = run(logits, [SamplingParams()] * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4) / draws
    assert torch.allclose(counts, torch.tensor(probs), atol=0.015)
    # temperature 0.5 squares the probabilities (then renormalizes)
    squared = torch.tensor(probs) ** 2
    squared /= squared.sum()
    out = run(logits, [SamplingParams(temperature=0.5)] * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4) / draws
    assert torch.allclose(counts, squared, atol=0.015)


# --- masks (support sets) -----------------------------------------------------------

PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(), {0, 1, 2, 3}),
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_k=4), {0, 1, 2, 3}),
        (SamplingParams(top_k=100), {0, 1, 2, 3}),  # above the vocabulary: off
        (SamplingParams(top_k=0), {0, 1, 2, 3}),
        (SamplingParams(top_p=0.4), {0}),  # mass before token 1 is 0.5 >= 0.4
        (SamplingParams(top_p=0.75), {0, 1}),  # before token 2: 0.8
        (SamplingParams(top_p=0.83), {0, 1, 2}),  # before token 3: 0.95
        (SamplingParams(top_p=0.99), {0, 1, 2, 3}),
        # top-k first, then top-p over the renormalized top 3: masses before are
        # 0, 0.526, 0.842 so 0.83 now drops token 2 as well.
        (SamplingParams(top_k=3, top_p=0.83), {0, 1}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # p >= 0.1
        (SamplingParams(min_p=0.5), {0, 1}),  # p >= 0.25
        (SamplingParams(min_p=1.0), {0}),
        # temperature 0.5 first: ratios to the top become 0.36, 0.09, 0.01
        (SamplingParams(temperature=0.5, min_p=0.2), {0, 1}),
        (SamplingParams(temperature=0.5, min_p=0.05), {0, 1, 2}),
        # temperature 0.5: probabilities 0.71, 0.26, 0.03, 0.00 -> top_p 0.9 keeps 2
        (SamplingParams(temperature=0.5, top_p=0.9), {0, 1}),
        # top_p then min_p: top_p keeps {0, 1, 2}, min_p 0.5 keeps {0, 1}
        (SamplingParams(top_p=0.83, min_p=0.5), {0, 1}),
    ],
)
def test_support_of_masks(params: SamplingParams, kept: set[int]) -> None:
    assert support(log_probs(PROBS), params) == kept


def test_masks_apply_per_row() -> None:
    """Rows with different knobs in one batch each get their own mask."""
    draws = 300
    logits = log_probs(PROBS).expand(3 * draws, -1).contiguous()
    params = [SamplingParams(top_k=1)] * draws + [SamplingParams(top_p=0.75)] * draws
    params += [SamplingParams()] * draws
    gens = [make_generator(0)] * (3 * draws)
    out = run(logits, params, gens).token_ids
    assert set(out[:draws]) == {0}
    assert set(out[draws : 2 * draws]) == {0, 1}
    assert set(out[2 * draws :]) == {0, 1, 2, 3}


def test_top_k_keeps_exactly_k_on_a_larger_vocab() -> None:
    logits = random_logits(1, 1000, seed=7)[0]
    top5 = set(logits.topk(5).indices.tolist())
    assert support(logits * 0.05, SamplingParams(top_k=5), draws=1000) == top5


def reference_kept(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The filters as specified, by a full sort: temperature, top-k, top-p over the
    renormalized top-k, min-p. `row` must have distinct values (no ties)."""
    vals, order = (row / p.temperature).sort(descending=True)
    keep = torch.ones(len(vals), dtype=torch.bool)
    if 0 < p.top_k < len(vals):
        keep[p.top_k :] = False
    probs = vals.masked_fill(~keep, -math.inf).softmax(dim=-1)
    if p.top_p < 1:
        keep &= probs.cumsum(dim=-1) - probs < p.top_p
    keep &= (vals - vals[0]).exp() >= p.min_p
    return set(order[keep].tolist())


def plateau_logits(vocab: int, plateau: int, seed: int) -> torch.Tensor:
    """`plateau` tokens (scattered over the vocabulary) near-uniform, the rest below
    but together still ~8% of the mass."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(vocab, generator=g) * 0.1 - 2.0
    row[torch.randperm(vocab, generator=g)[:plateau]] = torch.linspace(2.0, 1.5, plateau)
    return row


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_p=0.7),
        SamplingParams(top_p=0.9, min_p=0.7),
        SamplingParams(temperature=0.7, top_k=150, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=40),
    ],
)
def test_top_p_on_candidates_matches_the_full_sort(params: SamplingParams) -> None:
    """Top-p rows look at the top 256 first: exact when those hold top_p of the mass."""
    row = plateau_logits(1000, plateau=200, seed=9)
    if params.top_k <= 0:  # top-p only: no fallback, and the rest weighs in the top-p
        top_256_mass = (row / params.temperature).softmax(-1).topk(256).values.sum()
        assert params.top_p <= top_256_mass < 0.95
    kept = reference_kept(row, params)
    assert 20 < len(kept) < 200  # a real cut, inside the plateau
    assert support(row, params, draws=4000) == kept


def test_top_p_falls_back_to_a_full_sort_when_the_top_256_are_not_enough() -> None:
    g = torch.Generator().manual_seed(10)
    row = torch.linspace(1.0, 0.0, 600)[torch.randperm(600, generator=g)]  # near-flat
    params = SamplingParams(top_p=0.6)
    assert row.softmax(-1).topk(256).values.sum() < 0.6  # the cut lies past 256
    kept = reference_kept(row, params)
    assert len(kept) == 286  # more than the 256 candidates
    assert support(row, params, draws=8000) == kept


def test_top_p_candidate_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the levels shrunk to (64, 128): cuts before 64, between 64 and 128, and past
    128 (full sort) in one batch, each row exact."""
    monkeypatch.setattr(sampler_module, "_TOP_P_CANDIDATES", (64, 128))
    g = torch.Generator().manual_seed(11)
    row = torch.linspace(1.0, 0.0, 400)[torch.randperm(400, generator=g)]  # near-flat
    cases = [(0.1, 27), (0.3, 85), (0.6, 191)]  # (top_p, tokens kept) by reference
    draws = 5000
    logits = row.expand(draws * len(cases), -1).contiguous()
    params = [SamplingParams(top_p=p) for p, _ in cases for _ in range(draws)]
    gen = make_generator(3)
    out = run(logits, params, [gen] * len(params)).token_ids
    for c, (top_p, n_kept) in enumerate(cases):
        kept = reference_kept(row, SamplingParams(top_p=top_p))
        assert len(kept) == n_kept
        assert set(out[c * draws : (c + 1) * draws]) == kept


# --- repetition penalty -------------------------------------------------------------


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=5)]
    out = run(logits, params, outputs=[[1, 3, 3]], prompts=[[0, 1]])
    # seen {0, 1, 3}: positive divided, negative multiplied, once each however often seen
    expected = torch.tensor([1.0, -2.0, 0.5, 1.5, -0.5]).log_softmax(-1)
    got = dict(out.logprobs[0].top)
    assert [got[i] for i in range(5)] == pytest.approx(expected.tolist(), abs=1e-6)
    assert out.token_ids == [3]


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0], [-1.0, -1.5, -4.0], [3.0, 2.0, 0.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)] * 2
    params.append(SamplingParams(temperature=0, repetition_penalty=0.5))  # encourages
    out = run(logits, params, outputs=[[], [0], [1]], prompts=[[0], [], []])
    # row 0: 3.0 / 2 = 1.5 < 2.0; row 1: -1.0 * 2 = -2.0 < -1.5; row 2: 2.0 / 0.5 = 4.0 > 3.0
    assert out.token_ids == [1, 1, 1]
    # without the penalty every row takes token 0
    plain = run(logits, [SamplingParams(temperature=0)] * 3, outputs=[[], [0], [1]])
    assert plain.token_ids == [0, 0, 0]


def test_repetition_penalty_restricts_a_sampled_row() -> None:
    # token 0 is seen; after the penalty 1 / 1e3 is far below token 1: top_k=1 -> token 1
    logits = torch.tensor([1.0, 0.9, -5.0])
    params = SamplingParams(top_k=1, repetition_penalty=1e3)
    g = make_generator(0)
    out = run(logits.expand(50, -1).contiguous(), [params] * 50, [g] * 50, prompts=[[0]] * 50)
    assert set(out.token_ids) == {1}


# --- logprobs -----------------------------------------------------------------------


def test_logprobs_equal_log_softmax() -> None:
    logits = random_logits(4, 300, seed=8)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.6, top_k=10, logprobs=3),
        SamplingParams(temperature=1.3, logprobs=0),
        SamplingParams(temperature=0),  # asks none
    ]
    gens = [None, make_generator(1), make_generator(2), None]
    out = run(logits, params, gens)
    ref = logits.log_softmax(dim=-1)  # before temperature and masks
    for i, k in [(0, 5), (1, 3), (2, 0)]:
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-5)
        vals, ids = ref[i].topk(k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-5)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert out.logprobs[3] is None
    assert out.logprobs[0].top[0] == (out.token_ids[0], out.logprobs[0].logprob)
    assert math.isclose(sum(math.exp(v) for v in ref[0].tolist()), 1.0, rel_tol=1e-4)


def test_mismatched_lengths_are_rejected() -> None:
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="sampler got 2 logits rows but 1 generators"):
        sampler(logits, [SamplingParams()] * 2, [None], [[], []], [[], []])
    with pytest.raises(ValueError, match="sampler got 2 logits rows but 3 params"):
        sampler(logits, [SamplingParams()] * 3, [None] * 2, [[], []], [[], []])


# --- presence / frequency penalties and min_tokens (issue 12) -------------------------


def test_presence_and_frequency_penalties_match_hand_computed_logprobs() -> None:
    # logit -= frequency * count + presence * (count > 0), over generated tokens only.
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5, -1.0]])
    output = [2, 2, 2, 0]  # token 2 three times, token 0 once
    prompt = [1, 1, 3]  # the prompt never counts
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.75, logprobs=4)
    out = run(logits, [p], outputs=[output], prompts=[prompt])
    expected = [1.0 - 0.75 - 0.5, 2.0, 3.0 - 3 * 0.75 - 0.5, 0.5, -1.0]  # [-0.25, 2, 0.25, .5, -1]
    lse = math.log(sum(math.exp(v) for v in expected))
    assert out.token_ids == [1]  # the penalties moved the argmax from 2 to 1
    lp = out.logprobs[0]
    assert lp is not None
    assert lp.logprob == pytest.approx(2.0 - lse, abs=1e-6)
    assert [t for t, _ in lp.top] == [1, 3, 2, 0]
    assert [v for _, v in lp.top] == pytest.approx([e - lse for e in (2.0, 0.5, 0.25, -0.25)])
    assert logits.tolist() == [[1.0, 2.0, 3.0, 0.5, -1.0]]  # the caller's tensor untouched


def test_negative_penalties_favour_repeats_and_rows_stay_independent() -> None:
    logits = torch.tensor([[1.0, 2.0, 1.5], [1.0, 2.0, 1.5], [1.0, 2.0, 1.5]])
    params = [
        SamplingParams(temperature=0, presence_penalty=-1.0),  # 1.5 + 1 > 2
        SamplingParams(temperature=0, frequency_penalty=-0.2),  # 1.5 + 0.2 < 2
        SamplingParams(temperature=0),  # plain greedy next to penalized rows
    ]
    out = run(logits, params, outputs=[[2], [2], [2]])
    assert out.token_ids == [2, 1, 1]


def test_penalties_apply_to_sampled_rows() -> None:
    # A frequency penalty of 2 on a token seen 10 times drops it by 20: never drawn.
    row = torch.tensor([5.0, 0.0, 0.0, 0.0])
    p = SamplingParams(temperature=1.0, frequency_penalty=2.0)
    g = make_generator(7)
    out = run(row.expand(300, -1).contiguous(), [p] * 300, [g] * 300, outputs=[[0] * 10] * 300)
    assert set(out.token_ids) == {1, 2, 3}


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    s = Sampler(eos_token_ids=[0])
    logits = torch.tensor([[9.0, 1.0, 8.0, 2.0]] * 4)
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2]),  # 2 outputs: masked
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2]),  # 3 outputs: free
        SamplingParams(temperature=0, min_tokens=3, ignore_eos=True),  # EOS not a stop here
        SamplingParams(temperature=0),
    ]
    outputs = [[5, 5], [5, 5, 5], [], []]
    out = s(logits, params, [None] * 4, outputs, [[]] * 4)
    assert out.token_ids == [3, 0, 0, 0]
    # Logprobs see the mask: EOS and the stop id have probability 0 under min_tokens.
    p = SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[2], logprobs=0)
    lp = s(logits[:1], [p], [None], [[]], [[]]).logprobs[0]
    assert lp is not None
    assert lp.token_id == 3
    assert lp.logprob == pytest.approx(2.0 - math.log(math.exp(1.0) + math.exp(2.0)))


def test_min_tokens_never_draws_masked_tokens() -> None:
    s = Sampler(eos_token_ids=[0, 1])
    row = torch.tensor([3.0, 3.0, 0.0, 0.0, 0.0])
    p = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[4])
    g = make_generator(3)
    out = s(row.expand(300, -1).contiguous(), [p] * 300, [g] * 300, [[9]] * 300, [[]] * 300)
    assert set(out.token_ids) == {2, 3}


def test_greedy_fast_path_is_kept_for_rows_without_the_new_options(monkeypatch) -> None:
    calls: list[int] = []
    real = sampler_module._sanitize
    monkeypatch.setattr(sampler_module, "_sanitize", lambda t: calls.append(1) or real(t))
    s = Sampler(eos_token_ids=[0])
    logits = random_logits(4, 50)
    plain = SamplingParams(temperature=0, min_tokens=2)  # past its min_tokens: fast path
    s(logits, [plain] * 4, [None] * 4, [[1, 2]] * 4, [[]] * 4)
    assert calls == []
    s(logits, [plain] * 4, [None] * 4, [[1]] * 4, [[]] * 4)  # under it: general path
    assert calls == [1]
