"""Which dtype `auto` picks, and the bf16 path checked on every machine.

Exact token parity with transformers is a float32 property, so every parity test
elsewhere asks for float32 itself. Here:

- `auto`'s resolution is tested with injected CPU flags, so both branches run on any
  CPU (and `make test-dtypes` runs the tests marked `dtype_auto`, those that read the
  flags, once more under each `PAGEDSERVE_CPU_FLAGS` setting: tests/dtype_guard.py);
- an engine left on `auto` is compared with one built with the dtype `auto` resolved
  to, in the same run, never with a fixed dtype;
- the bf16 engine is compared with transformers in bf16 and fp32 with a tolerance
  measured in the same run (torch emulates bf16 where the CPU lacks the instructions,
  so this runs everywhere).
"""

from __future__ import annotations

import pytest
import torch
from builders import load_hf, tiny_checkpoint

from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.config import (
    CPU_FLAGS_ENV,
    cpu_flags,
    cpu_has_native_bf16,
    resolve_dtype,
)
from pagedserve.common.core.llm import LLM

AMX_XEON = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
BF16_ONLY = frozenset({"avx512f", "avx512_bf16"})
NO_BF16 = frozenset({"avx2", "avx512f", "avx512_vnni"})


@pytest.mark.parametrize(
    ("flags", "device", "expected"),
    [
        (AMX_XEON, "cpu", "bfloat16"),
        (BF16_ONLY, "cpu", "bfloat16"),
        (NO_BF16, "cpu", "float32"),
        (frozenset(), "cpu", "float32"),
        (NO_BF16, "cuda", "bfloat16"),
        (NO_BF16, "cuda:1", "bfloat16"),
    ],
)
def test_auto_resolution_by_cpu_flags(flags, device, expected):
    assert resolve_dtype("auto", device, flags) == expected


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_explicit_dtype_is_never_overridden(dtype):
    for flags in (AMX_XEON, NO_BF16):
        assert resolve_dtype(dtype, "cpu", flags) == dtype


@pytest.mark.dtype_auto
def test_cpu_flags_switch(monkeypatch):
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx512f,amx_bf16 sse4_2")
    assert cpu_flags() == {"avx512f", "amx_bf16", "sse4_2"}
    assert cpu_has_native_bf16() and resolve_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx512f")
    assert not cpu_has_native_bf16() and resolve_dtype("auto", "cpu") == "float32"
    monkeypatch.setenv(CPU_FLAGS_ENV, "")
    assert cpu_flags() == frozenset() and resolve_dtype("auto", "cpu") == "float32"


@pytest.mark.dtype_auto
def test_cpu_flags_read_from_cpuinfo_without_the_switch(monkeypatch):
    monkeypatch.delenv(CPU_FLAGS_ENV, raising=False)
    try:
        with open("/proc/cpuinfo") as f:
            line = next(ln for ln in f if ln.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags line on this machine")
    assert cpu_flags() == frozenset(line.partition(":")[2].split())


@pytest.mark.dtype_auto
def test_auto_engine_equals_engine_in_the_resolved_dtype():
    """`auto` means "whatever it resolves to here": compare with exactly that."""
    path = str(tiny_checkpoint("llama"))
    auto = LLM(path, num_blocks=64, max_model_len=256)
    resolved = resolve_dtype("auto", "cpu")
    assert auto.engine.dtype_name == resolved
    explicit = LLM(path, dtype=resolved, num_blocks=64, max_model_len=256)
    prompts = [[5 + i, 17, 40 + 3 * i, 9, 300 - i, 12, 77] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.completions[0].token_ids for o in auto.generate(prompts, params)]
    want = [o.completions[0].token_ids for o in explicit.generate(prompts, params)]
    assert got == want


# Where transformers' bf16 top-1 beats its runner-up by less than this (nats), the
# argmax is a coin toss between two bf16 computations and is not compared.
NEAR_TIE_NATS = 0.1
# The engine's bf16 logprob error (against fp32) may be this many times transformers'
# own bf16 error on the same tokens, plus a floor for positions where transformers
# happens to round well. Both engines round every matmul to bf16, in different orders;
# measured here, the engine's error equals transformers' to 1e-6 (the logits' own bf16
# rounding dominates), so 2x leaves room for another CPU's kernels, not for a bug.
BF16_ERROR_RATIO = 2.0
BF16_ERROR_FLOOR = 0.02


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_engine_tracks_transformers_bf16(arch):
    path = tiny_checkpoint(arch)
    llm = LLM(str(path), dtype="bfloat16", num_blocks=64, max_model_len=256)
    hf32, hf16 = load_hf(path, torch.float32), load_hf(path, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    engine_err, hf_err, compared = [], [], 0
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        c = out.completions[0]
        ids = torch.tensor([prompt + c.token_ids])
        with torch.inference_mode():
            ref32 = torch.log_softmax(hf32(ids).logits[0].float(), -1)
            ref16 = torch.log_softmax(hf16(ids).logits[0].float(), -1)
        for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            pos = len(prompt) - 1 + i  # the position whose logits chose token i
            assert lp is not None and lp.token_id == tok
            engine_err.append(abs(lp.logprob - ref32[pos, tok].item()))
            hf_err.append(abs(ref16[pos, tok].item() - ref32[pos, tok].item()))
            top2 = ref16[pos].topk(2).values
            if (top2[0] - top2[1]).item() > NEAR_TIE_NATS:
                compared += 1
                assert tok == ref16[pos].argmax().item(), (
                    f"{arch}: greedy token {i} of prompt len {len(prompt)} is {tok}, "
                    f"transformers bf16 says {ref16[pos].argmax().item()}"
                )
    assert compared >= len(engine_err) // 2, "too few positions away from a near-tie"
    bound = max(BF16_ERROR_RATIO * max(hf_err), BF16_ERROR_FLOOR)
    assert max(engine_err) <= bound, (
        f"{arch}: engine bf16 logprob error {max(engine_err):.4f} > {bound:.4f} "
        f"(transformers bf16: {max(hf_err):.4f})"
    )
