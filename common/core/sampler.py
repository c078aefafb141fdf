"""Turns one row of logits per sequence into the next token of that sequence.

Order of operations per row (the HF "logits processors then warpers" order):

    repetition penalty  (over prompt + output tokens, HF semantics)
    -> presence / frequency penalties (over output tokens only, OpenAI semantics)
    -> min_tokens: EOS and stop token ids masked while the output is shorter
    -> greedy rows: argmax, done
    -> temperature -> top_k -> top_p -> min_p -> draw with the row's generator

Logprobs, when asked for, are those of the distribution after the penalties and the
min_tokens mask but before temperature, top-k, top-p and min-p: log_softmax of the penalized logits.
They do not change with the sampling knobs, and a greedy row's chosen token is the
top-1 of its logprobs.

Decisions:
- A draw is inverse-CDF sampling with ONE uniform per row: cumsum of the row's
  unnormalized weights exp(logit - max), then `searchsorted`. The alternatives cost
  V random numbers per row (the exponential race / Gumbel-max: 120 ms for 64 x 49152
  on this CPU, `torch.multinomial` 80 ms) against ~13 ms here. Unseeded rows share one
  batched `torch.rand`; a seeded row draws its uniform from its own generator, so its
  tokens never depend on which other requests share the batch, and it consumes exactly
  one number per step. The cumsum is float32: an error of ~1e-5 in a token's
  probability; a zero-weight (masked) token is never drawn.
- min-p needs no softmax: with w_i = exp(l_i - l_max) = p_i / p_max it is `w < min_p`
  (on temperature-scaled logits; the earlier filters never remove the top token).
- top-k and top-p work on sorted candidates from `torch.topk`, never a full-vocab sort
  unless needed: k candidates for a top-k row; for a top-p-only row the top 256, exact
  whenever their probability mass reaches top_p (every token past them then has
  mass-before >= top_p and would be cut anyway); a row whose top 256 hold less tries
  the top 4096, then a full sort (`_TOP_P_CANDIDATES`). On this CPU, 64 x 49152:
  topk(256) ~13 ms, topk(4096) ~80 ms, a full sort ~230-470 ms (2 busy cores).
- top-k keeps exactly k tokens by rank (ties broken by the sort). top-p keeps a token
  while the mass strictly before it is < top_p (so the top token always stays),
  computed after top-k renormalizes.
- The caller's `logits` tensor is never modified.
- Presence / frequency penalties are one scatter over the (row, token) pairs of the
  penalized rows' outputs (`index_put_` with accumulate: the frequency term adds up per
  occurrence), never a [N, V] count tensor; the min_tokens mask is one scatter of -inf
  over (row, EOS or stop id) pairs. Rows that use neither cost nothing.
- Fast path: when every row is greedy, unpenalized (repetition, presence and
  frequency), past its min_tokens and asks no logprobs, the batch is
  one `argmax` and one `tolist()`: no per-row Python work, no sort. A row whose argmax
  lands on a NaN takes the general path (below), so a greedy row picks the same token
  whatever its neighbours ask for.

Numerical safety (every value `SamplingParams.validate` admits, fp32 or bf16 logits):
- Everything is computed in float32 on `_sanitize`d logits: NaN counts as -inf (never
  drawn); a row holding +inf keeps exactly its +inf tokens, equally likely (the limit
  of the distribution); a row with no finite logit at all (all -inf/NaN) has no
  distribution and is treated as uniform (greedy: its first token, as `argmax` gives).
- Temperature never divides a raw logit: weights are exp((l - max) / T), where l - max
  is in [-inf, 0], so neither a tiny T (1e-30) nor huge logits can overflow into inf
  and NaN; the top token always has weight exactly 1. T, the repetition penalty and
  top_p are clamped into float32's positive normal range, so a Python float that
  would round to 0 or inf in float32 (1e-300, 1e300) behaves as the nearest
  representable value: a tiny T samples among the exact ties of the top logit (the
  limit distribution), a huge T is uniform over the unmasked tokens.
- The top token is never masked by top-k, top-p or min-p, so every row keeps a token
  of positive weight and the inverse-CDF search stays inside the row.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.common.api.outputs import TokenLogprobs
from pagedserve.common.api.sampling_params import SamplingParams


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
    """Stateless: all per-request state (RNG, history) comes in with each call.

    `eos_token_ids`: the model's EOS set, masked for rows under their `min_tokens`
    (unless they `ignore_eos`); the engine passes its own set."""

    eos_token_ids: tuple[int, ...] = ()  # (a class default too: subclasses may skip __init__)

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))

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
        if all(_is_plain_greedy(p, len(o)) for p, o in zip(params, output_token_ids, strict=True)):
            fast = _fast_greedy(logits)
            if fast is not None:
                return SampleOutput(fast, [None] * n)

        logits = logits.float()  # [N, V]
        penalized = _apply_repetition_penalty(logits, params, output_token_ids, prompt_token_ids)
        penalized = _apply_output_penalties(penalized, logits, params, output_token_ids)
        penalized = _mask_before_min_tokens(
            penalized, logits, params, output_token_ids, self.eos_token_ids
        )
        penalized = _sanitize(penalized)  # [N, V], not written to (may be the caller's)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        chosen = torch.empty(n, dtype=torch.long, device=logits.device)  # [N]
        if greedy_rows:
            chosen[greedy_rows] = _take(penalized, greedy_rows).argmax(dim=-1)
        if sample_rows:
            chosen[sample_rows] = _sample_rows(penalized, sample_rows, params, generators)
        token_ids = chosen.tolist()
        return SampleOutput(token_ids, _logprobs(penalized, token_ids, params))


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] for sorted distinct `rows`, without the copy when they are all rows."""
    return t if len(rows) == t.shape[0] else t[rows]


def _check_lengths(n: int, *lists: Sequence) -> None:
    names = ("params", "generators", "output_token_ids", "prompt_token_ids")
    for name, seq in zip(names, lists, strict=True):
        if len(seq) != n:
            raise ValueError(f"sampler got {n} logits rows but {len(seq)} {name}")


_F32 = torch.finfo(torch.float32)


def _f32_positive(values: list[float], device: torch.device) -> torch.Tensor:
    """Positive Python floats as float32, clamped into float32's normal range (a value
    that would round to 0 or inf keeps its meaning: tiny, or huge)."""
    return torch.tensor(values, dtype=torch.float64).clamp(_F32.tiny, _F32.max).float().to(device)


def _fast_greedy(logits: torch.Tensor) -> list[int] | None:
    """argmax per row; None when some row's argmax is a NaN (torch ranks NaN highest),
    which the general path treats as -inf."""
    chosen = logits.argmax(dim=-1)  # [N]
    if logits.dtype.is_floating_point and logits.gather(1, chosen[:, None]).isnan().any():
        return None
    return chosen.tolist()


def _sanitize(logits: torch.Tensor) -> torch.Tensor:
    """float32 [N, V] -> a copy without NaN or +inf (see the module doc): NaN -> -inf;
    a row with +inf -> 0 at its +inf tokens, -inf elsewhere; a row with no finite
    logit -> all 0 (uniform). Finite rows are unchanged; an all-finite batch (the usual
    case) is returned as it is, after one pass. Nothing downstream writes into it."""
    if torch.isfinite(logits).all():
        return logits
    out = torch.nan_to_num(logits, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    posinf = out == math.inf  # [N, V]
    inf_rows = posinf.any(dim=-1)  # [N]
    if inf_rows.any():
        flat = torch.full_like(out, -math.inf).masked_fill_(posinf, 0.0)
        out = torch.where(inf_rows[:, None], flat, out)
    dead = out.max(dim=-1).values == -math.inf  # [N] nothing finite left
    if dead.any():
        out[dead] = 0.0
    return out


def _is_plain_greedy(p: SamplingParams, output_len: int) -> bool:
    return (
        p.temperature == 0
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0
        and p.frequency_penalty == 0
        and output_len >= p.min_tokens
        and p.logprobs is None
    )


def _writable(t: torch.Tensor, caller: torch.Tensor) -> torch.Tensor:
    """`t` itself when an earlier step already copied it, else a copy: the caller's
    logits are never written to."""
    return t.clone() if t is caller else t


def _apply_output_penalties(
    logits: torch.Tensor,  # [N, V] float32, maybe the caller's
    caller: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """OpenAI semantics: logit -= frequency * count + presence * (count > 0), count =
    occurrences in the row's generated tokens. One accumulating scatter for the
    frequency term (one entry per occurrence), one plain scatter for the presence
    term (one entry per distinct token)."""
    f_rows: list[int] = []
    f_cols: list[int] = []
    f_vals: list[float] = []
    p_rows: list[int] = []
    p_cols: list[int] = []
    p_vals: list[float] = []
    for i, p in enumerate(params):
        out = output_token_ids[i]
        if not out:
            continue
        if p.frequency_penalty != 0:
            f_rows.extend([i] * len(out))
            f_cols.extend(out)
            f_vals.extend([-p.frequency_penalty] * len(out))
        if p.presence_penalty != 0:
            seen = set(out)
            p_rows.extend([i] * len(seen))
            p_cols.extend(seen)
            p_vals.extend([-p.presence_penalty] * len(seen))
    if not f_rows and not p_rows:
        return logits
    out_t = _writable(logits, caller)
    device = logits.device
    for rows, cols, vals in ((f_rows, f_cols, f_vals), (p_rows, p_cols, p_vals)):
        if rows:
            index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
            out_t.index_put_(index, torch.tensor(vals, device=device), accumulate=True)
    return out_t


def _mask_before_min_tokens(
    logits: torch.Tensor,  # [N, V] float32, maybe the caller's
    caller: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """-inf at the EOS ids (unless ignore_eos) and stop token ids of every row that has
    generated fewer than its min_tokens. Ids outside the row are skipped (a stop id is
    checked against the vocabulary at validation; an EOS id of a config may not be)."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids)
        if not p.ignore_eos:
            banned.update(eos_token_ids)
        banned = {t for t in banned if 0 <= t < vocab}
        rows.extend([i] * len(banned))
        cols.extend(banned)
    if not rows:
        return logits
    out = _writable(logits, caller)
    out[torch.tensor(rows, device=out.device), torch.tensor(cols, device=out.device)] = -math.inf
    return out


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
    penalty = _f32_positive([p.repetition_penalty for p in params], logits.device)[r]  # [M]
    seen_logits = out[r, c]  # [M]
    out[r, c] = torch.where(seen_logits > 0, seen_logits / penalty, seen_logits * penalty)
    return out


# Candidates a top-p-only row tries in turn before a full sort (see the module doc).
_TOP_P_CANDIDATES = (256, 4096)


def _sample_rows(
    logits: torch.Tensor,  # [N, V] penalized
    rows: list[int],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Draw one token for each of `rows` (none greedy); returns [R] token ids."""
    ps = [params[i] for i in rows]
    vocab = logits.shape[1]
    device = logits.device
    sub = _take(logits, rows)  # [R, V]
    temperature = _f32_positive([p.temperature for p in ps], device)  # [R]
    u = _uniforms([generators[i] for i in rows], device)  # [R]
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)  # [R]
    cut = [j for j, p in enumerate(ps) if 0 < p.top_k < vocab or p.top_p < 1.0]
    whole = [j for j, p in enumerate(ps) if not (0 < p.top_k < vocab or p.top_p < 1.0)]
    if whole:
        weights = _weights(_take(sub, whole), temperature[whole], [ps[j] for j in whole])
        tokens[whole] = _inverse_cdf(weights, u[whole])
    if cut:
        tokens[cut] = _sample_top_k_top_p(
            _take(sub, cut), temperature[cut], [ps[j] for j in cut], u[cut]
        )
    return tokens


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[R] uniforms in [0, 1): one batched draw for the unseeded rows, one number from
    its own generator for each seeded row."""
    u = torch.empty(len(generators), device=device)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), device=device)
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand(1, generator=g, device=device)[0]
    return u


def _weights(
    logits: torch.Tensor, temperature: torch.Tensor, ps: list[SamplingParams]
) -> torch.Tensor:
    """logits: [S, K] (-inf where masked), temperature: [S]. Returns the unnormalized
    probabilities w = exp((l - max) / T) = p / p_max, zeroed where w < min_p.

    Each row has a finite max (see `_sanitize`), so l - max is in [-inf, 0], never
    NaN, and dividing it by any T in float32's normal range cannot overflow."""
    top = logits.max(dim=-1, keepdim=True).values  # [S, 1]
    w = (logits - top).div_(temperature[:, None]).exp_()  # [S, K] in [0, 1], the top 1
    if any(p.min_p > 0 for p in ps):
        min_p = torch.tensor([p.min_p for p in ps], device=logits.device)
        w.masked_fill_(w < min_p[:, None], 0.0)
    return w


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights: [S, K] >= 0, each row with a positive entry; u: [S] in [0, 1).
    Returns [S] column indices drawn with probability weight / row sum."""
    cdf = weights.cumsum(dim=-1)  # [S, K]
    total = cdf[:, -1:]  # [S, 1]
    # u * total may round up to total; the largest float below it keeps the search
    # inside the row. cdf[i-1] <= v < cdf[i] means weights[i] > 0.
    v = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v, right=True).squeeze(1)


def _sample_top_k_top_p(
    logits: torch.Tensor,  # [S, V] penalized, not yet divided by the temperature
    temperature: torch.Tensor,  # [S]
    ps: list[SamplingParams],
    u: torch.Tensor,  # [S]
    level: int = 0,
) -> torch.Tensor:
    """Draw for rows with a top-k or a top-p; returns [S] token ids.

    Rows are grouped by their own candidate count (their k, or the top-p level's), one
    `topk` per group: which of several tied logits `topk` returns depends on how many
    it is asked for, so a row's candidates - and a seeded row's tokens - must not
    depend on the k of the other rows in the batch."""
    vocab = logits.shape[1]
    groups: dict[int, list[int]] = {}
    for j, p in enumerate(ps):
        groups.setdefault(_num_candidates(p, vocab, level), []).append(j)
    if len(groups) == 1:
        return _sample_candidates(logits, temperature, ps, u, level)
    tokens = torch.empty(len(ps), dtype=torch.long, device=logits.device)  # [S]
    for rows in groups.values():
        tokens[rows] = _sample_candidates(
            _take(logits, rows), temperature[rows], [ps[j] for j in rows], u[rows], level
        )
    return tokens


def _num_candidates(p: SamplingParams, vocab: int, level: int) -> int:
    """A top-k row's k; a top-p-only row's candidates at this level (all V past the last)."""
    if 0 < p.top_k < vocab:
        return p.top_k
    tries = _TOP_P_CANDIDATES
    return min(tries[level], vocab) if level < len(tries) else vocab


def _sample_candidates(
    logits: torch.Tensor,  # [S, V] penalized, not yet divided by the temperature
    temperature: torch.Tensor,  # [S]
    ps: list[SamplingParams],
    u: torch.Tensor,  # [S]
    level: int,
) -> torch.Tensor:
    """Draw for rows that share one candidate count; returns [S] token ids.

    Works on sorted candidates vals/idx [S, K]: K = the largest k, and at least
    _TOP_P_CANDIDATES[level] when some row has top-p only (all V past the last level);
    called per group by `_sample_top_k_top_p`, so K is every row's own count.
    The temperature never changes the order: only the candidates are divided by it."""
    vocab = logits.shape[1]
    k_list = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
    top_p_only = [j for j, kj in enumerate(k_list) if kj == vocab]
    n_cand = max((kj for kj in k_list if kj < vocab), default=0)
    if top_p_only:
        tries = _TOP_P_CANDIDATES
        n_cand = max(n_cand, tries[level] if level < len(tries) else vocab)
    n_cand = min(n_cand, vocab)
    vals, idx = logits.topk(n_cand, dim=-1)  # [S, K] descending, vals[:, 0] finite
    top = vals[:, :1]  # [S, 1] each row's max
    vals = (vals - top) / temperature[:, None]  # in [-inf, 0]: no overflow for a tiny T
    k = torch.tensor(k_list, device=logits.device)  # [S]
    rank = torch.arange(n_cand, device=logits.device)  # [K]
    vals = vals.masked_fill(rank[None, :] >= k[:, None], -math.inf)  # top-k by rank

    # top-p over the distribution after top-k: a top-k row is normalized over its
    # candidates, a top-p-only row over the whole vocabulary.
    lse = vals.logsumexp(dim=-1)  # [S]
    partial = top_p_only if n_cand < vocab else []  # normalized over more than vals
    if partial:
        scaled = (logits[partial] - top[partial]) / temperature[partial, None]  # [P, V]
        lse[partial] = scaled.logsumexp(dim=-1)
    probs = (vals - lse[:, None]).exp()  # [S, K]
    # A row whose candidates hold less mass than its top_p is cut past them: next level.
    mass = probs[partial].sum(dim=-1).tolist() if partial else []
    short = [j for j, m in zip(partial, mass, strict=True) if m < ps[j].top_p]
    top_p = _f32_positive([p.top_p if p.top_p < 1.0 else math.inf for p in ps], u.device)
    mass_before = probs.cumsum(dim=-1) - probs  # exclusive: the top token always stays
    cut_p = mass_before >= top_p[:, None]  # [S, K]
    cut_p[:, 0] = False  # the top token stays whatever rounding did
    vals = vals.masked_fill(cut_p, -math.inf)

    ones = torch.ones_like(temperature)  # vals are already scaled
    weights = _weights(vals, ones, ps)  # [S, K]
    tokens = idx.gather(1, _inverse_cdf(weights, u)[:, None]).squeeze(1)  # [S]
    if short:
        tokens[short] = _sample_top_k_top_p(
            logits[short], temperature[short], [ps[j] for j in short], u[short], level + 1
        )
    return tokens


def _logprobs(
    penalized: torch.Tensor,  # [N, V]
    token_ids: list[int],
    params: Sequence[SamplingParams],
) -> list[TokenLogprobs | None]:
    """log_softmax(penalized) at the chosen token and its top-k, without materializing
    the [N, V] log_softmax: logprob = logit - logsumexp, and the order is the logits'."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    sub = _take(penalized, rows)  # [S, V]
    lse = sub.logsumexp(dim=-1, keepdim=True)  # [S, 1]
    chosen_ids = torch.tensor([token_ids[i] for i in rows], device=sub.device)
    chosen = (sub.gather(1, chosen_ids[:, None]) - lse).squeeze(1).tolist()  # [S]
    kmax = min(max(params[i].logprobs for i in rows), sub.shape[1])  # type: ignore[type-var]
    top_vals, top_ids = sub.topk(kmax, dim=-1)  # [S, kmax]
    top_vals, top_ids = (top_vals - lse).tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = params[i].logprobs
        top = list(zip(top_ids[j][:k], top_vals[j][:k], strict=True))
        out[i] = TokenLogprobs(token_ids[i], chosen[j], top)
    return out
