"""Block hashing: the chained hash that names a full block of tokens.

Its own module because two layers need it: the block manager keys its prefix cache
by these hashes, and the router computes a request's hashes to ask the prefix index
which worker holds them. Torch-free, no state.

Bad input raises `HashInputError` (a ValueError); the block manager's
`InvalidArgumentError` is a subclass of it, so callers of either catch the same.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 16-byte blake2b digest

HASH_SIZE = 16


class HashInputError(ValueError):
    """A token id, parent hash, model id or salt that cannot be hashed."""


def extra_key(model_id: str, cache_salt: str | None) -> bytes:
    """The non-token part of every block hash: model identity and optional tenant salt.

    Encoding: uint32 LE length + UTF-8 model id, then 0x00 (no salt) or
    0x01 + uint32 LE length + UTF-8 salt. Length prefixes keep ("ab", "c") apart from
    ("a", "bc"), and no salt apart from an empty one.
    """
    if not isinstance(model_id, str):
        raise HashInputError(f"model_id must be a str, got {type(model_id).__name__}")
    model = model_id.encode()
    key = struct.pack("<I", len(model)) + model
    if cache_salt is None:
        return key + b"\x00"
    if not isinstance(cache_salt, str):
        raise HashInputError(f"cache_salt must be a str or None, got {cache_salt!r}")
    salt = cache_salt.encode()
    return key + b"\x01" + struct.pack("<I", len(salt)) + salt


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes) -> BlockHash:
    """Chained hash of one block: blake2b(digest_size=16) over

    0x00                      (first block)   or   0x01 + parent (16 bytes)
    uint32 LE  number of tokens
    uint32 LE  each token id
    extra                     (see `extra_key`)
    """
    h = hashlib.blake2b(digest_size=HASH_SIZE)
    if parent is None:
        h.update(b"\x00")
    elif len(parent) == HASH_SIZE:
        h.update(b"\x01" + parent)
    else:
        raise HashInputError(f"parent hash must be {HASH_SIZE} bytes, got {len(parent)}")
    try:
        h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    except struct.error as e:
        raise HashInputError(f"token ids must be ints in [0, 2**32): {e}") from None
    h.update(extra)
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str = "",
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """One chained hash per *full* block of `token_ids` (a trailing partial block has none).

    The router computes a request's hashes with this function; they equal the hashes a
    `BlockManager(block_size=..., model_id=...)` stores for the same tokens and salt.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise HashInputError(f"block_size must be a positive int, got {block_size!r}")
    extra = extra_key(model_id, cache_salt)
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
