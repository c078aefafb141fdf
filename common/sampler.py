"""Turns one row of logits per sequence into the next token of that sequence.

Order of operations per row (the HF "logits processors then warpers" order):

    repetition penalty  (over prompt + output tokens, HF semantics)
    -> greedy rows: argmax, done
    -> temperature -> top_k -> top_p -> min_p -> draw with the row's generator

Logprobs, when asked for, are those of the distribution after the repetition penalty
but before temperature, top-k, top-p and min-p: log_softmax of the penalized logits.
They do not change with the sampling knobs, and a greedy row's chosen token is the
top-1 of its logprobs.

Decisions:
- Drawing uses the exponential race (argmax of logit - log E, E ~ Exp(1)), which is
  exactly a draw from softmax(logits): it needs no softmax and no cumsum, batches
  the unseeded rows into one noise tensor, and a seeded row only ever consumes its own
  generator, so its tokens do not depend on which other requests share the batch.
- top-k keeps exactly k tokens by rank (ties broken by the sort), and top-k and top-p
  share one sort: `torch.topk(max k)` when every such row has a top-k, a full sort only
  when some row has top-p without top-k.
- min-p needs no softmax: p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p)
  (on temperature-scaled logits; masking never removes the top token, so the maximum
  is unchanged by the earlier filters).
- The caller's `logits` tensor is never modified.
- Fast path: when every row is greedy, unpenalized and asks no logprobs, the batch is
  one `argmax` and one `tolist()`: no per-row Python work, no sort.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.common.sampling_params import SamplingParams


@dataclass
class TokenLogprobs:
    token_id: int  # the chosen token
    logprob: float  # its logprob
    top: list[tuple[int, float]]  # the `logprobs` most likely (id, logprob), descending


@dataclass
class SampleOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # one per row; None where the row asked none


def make_generator(
    seed: int | None, sample_index: int = 0, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The RNG of sample `sample_index` of a request with `seed`; None when unseeded.

    The generator seed is a stable hash of (seed, sample_index), the same in every
    process and on every machine, so the n samples of one request get unrelated streams
    and request seed s + 1 does not replay sample 1 of seed s. Create it once per sample
    and pass it every step: the stream advances with each token drawn. To continue a
    stream in another process (prefill worker -> decode worker), ship
    `generator.get_state()` and `set_state` it there.
    """
    if seed is None:
        return None
    digest = hashlib.blake2b(
        f"{seed}:{sample_index}".encode(), digest_size=8, person=b"pagedsrv"
    ).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest, "little"))
    return g


class Sampler:
    """Stateless: all per-request state (RNG, history) comes in with each call."""

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V] one row per sequence to sample
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
    ) -> SampleOutput:
        n = logits.shape[0]
        _check_lengths(n, params, generators, output_token_ids, prompt_token_ids)
        if all(_is_plain_greedy(p) for p in params):
            return SampleOutput(logits.argmax(dim=-1).tolist(), [None] * n)

        logits = logits.float()  # [N, V]
        penalized = _apply_repetition_penalty(
            logits, params, output_token_ids, prompt_token_ids
        )  # [N, V], a copy when any row is penalized
        chosen = penalized.argmax(dim=-1)  # [N]; right for greedy rows
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sample_rows:
            chosen[sample_rows] = _sample_rows(penalized, sample_rows, params, generators)
        token_ids = chosen.tolist()
        return SampleOutput(token_ids, _logprobs(penalized, token_ids, params))


def _check_lengths(n: int, *lists: Sequence) -> None:
    names = ("params", "generators", "output_token_ids", "prompt_token_ids")
    for name, seq in zip(names, lists, strict=True):
        if len(seq) != n:
            raise ValueError(f"sampler got {n} logits rows but {len(seq)} {name}")


def _is_plain_greedy(p: SamplingParams) -> bool:
    return p.temperature == 0 and p.repetition_penalty == 1.0 and p.logprobs is None


def _apply_repetition_penalty(
    logits: torch.Tensor,  # [N, V]
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    prompt_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """HF semantics: every token seen in prompt or output, once, logit > 0 divided by
    the penalty, logit <= 0 multiplied. Touches only the seen tokens (no full-vocab op)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(params):
        if p.repetition_penalty == 1.0:
            continue
        seen = set(prompt_token_ids[i])
        seen.update(output_token_ids[i])
        rows.extend([i] * len(seen))
        cols.extend(seen)
    if not rows:
        return logits
    out = logits.clone()
    r = torch.tensor(rows, device=logits.device)  # [M]
    c = torch.tensor(cols, device=logits.device)  # [M]
    penalty = torch.tensor(
        [p.repetition_penalty for p in params], dtype=logits.dtype, device=logits.device
    )[r]  # [M]
    seen_logits = out[r, c]  # [M]
    out[r, c] = torch.where(seen_logits > 0, seen_logits / penalty, seen_logits * penalty)
    return out


def _sample_rows(
    logits: torch.Tensor,  # [N, V] penalized
    rows: list[int],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Draw one token for each of `rows` (none greedy); returns [len(rows)] token ids."""
    ps = [params[i] for i in rows]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in ps], device=device)
    x = logits[rows] / temperature[:, None]  # [R, V], a new tensor
    x = _apply_top_k_top_p(x, ps)
    x = _apply_min_p(x, ps)
    noise = _exponential_noise(x, [generators[i] for i in rows])  # [R, V]
    return (x - noise.log_()).argmax(dim=-1)


def _apply_top_k_top_p(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """x: [R, V] temperature-scaled. Masks (to -inf) what top-k, then top-p, removes."""
    vocab = x.shape[1]
    k = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
    top_p = [p.top_p for p in ps]
    rows = [j for j in range(len(ps)) if k[j] < vocab or top_p[j] < 1.0]
    if not rows:
        return x
    sub = x[rows]  # [S, V]
    k_rows = torch.tensor([k[j] for j in rows], device=x.device)  # [S]
    kmax = int(k_rows.max())
    if kmax < vocab:  # every row here has a top-k: sort only the k largest
        vals, idx = sub.topk(kmax, dim=-1)  # [S, kmax], descending
    else:
        vals, idx = sub.sort(dim=-1, descending=True)  # [S, V]
    rank = torch.arange(vals.shape[1], device=x.device)  # [K]
    vals = vals.masked_fill(rank[None, :] >= k_rows[:, None], -math.inf)  # top-k by rank
    p_rows = torch.tensor([top_p[j] for j in rows], device=x.device)  # [S]
    probs = vals.softmax(dim=-1)  # [S, K]
    mass_before = probs.cumsum(dim=-1) - probs  # exclusive: the top token always stays
    vals = vals.masked_fill(mass_before >= p_rows[:, None], -math.inf)
    kept = torch.full_like(sub, -math.inf).scatter_(1, idx, vals)  # [S, V]
    x[rows] = kept
    return x


def _apply_min_p(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """x: [R, V]. Keep tokens with p >= min_p * p_max, i.e. logit >= max + log(min_p)."""
    rows = [j for j, p in enumerate(ps) if p.min_p > 0]
    if not rows:
        return x
    sub = x[rows]  # [S, V]
    log_min_p = torch.tensor([math.log(ps[j].min_p) for j in rows], device=x.device)
    threshold = sub.max(dim=-1, keepdim=True).values + log_min_p[:, None]  # [S, 1]
    x[rows] = sub.masked_fill(sub < threshold, -math.inf)
    return x


def _exponential_noise(x: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """[R, V] iid Exp(1): one batched draw from the global RNG for unseeded rows, the
    row's own generator for seeded ones. Clamped away from 0 so log() stays finite."""
    noise = torch.empty_like(x)
    if any(g is None for g in generators):
        noise.exponential_()
    for j, g in enumerate(generators):
        if g is not None:
            noise[j].exponential_(generator=g)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def _logprobs(
    penalized: torch.Tensor,  # [N, V]
    token_ids: list[int],
    params: Sequence[SamplingParams],
) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    lp = penalized[rows].log_softmax(dim=-1)  # [S, V]
    chosen_ids = torch.tensor([token_ids[i] for i in rows], device=lp.device)
    chosen = lp.gather(1, chosen_ids[:, None]).squeeze(1).tolist()  # [S]
    kmax = max(params[i].logprobs for i in rows)  # type: ignore[type-var]
    top_vals, top_ids = lp.topk(kmax, dim=-1)  # [S, kmax]
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = params[i].logprobs
        top = list(zip(top_ids[j][:k], top_vals[j][:k], strict=True))
        out[i] = TokenLogprobs(token_ids[i], chosen[j], top)
    return out
