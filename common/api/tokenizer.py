"""Tokenizer helpers: loading from a checkpoint dir and chat-template encoding.

The router, the client side of the CLI and the engine all load the tokenizer through
`load_tokenizer`, so a prompt becomes the same ids on every hop. A checkpoint with a
`tokenizer.json` (every model this package ships or tests) is loaded as a
`PreTrainedTokenizerFast`, which does not import torch (`AutoTokenizer` does, through
its model registry), so the router stays a torch-free process. Only a checkpoint
without `tokenizer.json` (sentencepiece files only) goes through `AutoTokenizer`.

`transformers` 5.x returns a `BatchEncoding` from `apply_chat_template(tokenize=True)`
where 4.x returned a list; `encode_chat` hides the difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a local checkpoint dir (never downloads)."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    from transformers import AutoTokenizer  # imports torch: only for tokenizer.json-less dirs

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, str]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `messages` ([{"role": ..., "content": ...}]) under the chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template")
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
    out = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True
    )
    ids = out["input_ids"] if not isinstance(out, list) else out
    return [int(t) for t in ids]
