"""The paged KV-cache block manager: allocation, refcounts, copy-on-write, prefix caching.

The KV cache is a pool of `num_blocks` physical blocks of `block_size` token slots. A
sequence owns a *block table* (logical block i -> physical block id); the token at
position p lives in slot `block_table[p // block_size] * block_size + p % block_size`.

Every physical block is in exactly one of three places:

    free          no hash, refcount 0              deque, FIFO: taken from the left
    cached-free   full, hashed, refcount 0         OrderedDict, LRU at the front, O(1)
    used          refcount >= 1 (maybe also hashed)

Lifecycle of a sequence:

    allocate(seq, prompt)   longest cached prefix chain (refcount++) + fresh blocks
    mark_computed(seq, n)   tokens [0, n) have K/V: their full blocks get hashed and cached
    append_tokens(seq, ids) slots for new tokens; a new block only when the last one is full;
                            copy-on-write first if the last block is partial and shared
    fork(seq, child)        child shares every block (parallel samples, beam candidates)
    free(seq)               refcount--; at 0 a hashed block goes to the LRU, others to free

Decisions:
- Only full blocks are hashed, cached or shared by prefix, so a cached block is never
  written again and block tables stay append-only (as in vLLM v1).
- The chained hash `h_i = H(h_{i-1}, tokens of block i, extra)` uses blake2b-128 over a
  fixed byte encoding (see `hash_block`), never Python's `hash()`: the cluster-wide prefix
  index stores these hashes, so they must agree across processes and machines. `extra`
  carries the model identity and the request's optional `cache_salt` (tenant isolation).
  A hit also compares token ids, so a hash collision can never return wrong K/V.
- If a computed block's hash already maps to another block (two sequences computed the
  same content at the same time), this block stays private and is not cached.
- Allocation takes never-cached free blocks first and evicts the least recently freed
  cached block only when none is left. `free` releases a table in reverse order, so the
  tail of a sequence (least likely to be shared) is evicted before its head.
- Every cache change is an event (`BlockStored`, `BlockRemoved`) that the prefix index
  consumes through `drain_events`.
- Misuse raises a `BlockManagerError` subclass and leaves the state unchanged.

This module is engine core: standard library only.

Size: over the ~500-line mark on purpose. Allocation, refcounts, copy-on-write, the
prefix-hash map and the LRU of cached blocks share one set of invariants
(`check_integrity`), and every verb touches several of them; split apart, each half
would have to trust the other's bookkeeping. About a third is docstrings and errors.
"""

from __future__ import annotations

import operator
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.common.api.hashing import (
    BlockHash,
    HashInputError,
    extra_key,
    hash_block,
)

MAX_TOKEN_ID = 2**32 - 1  # token ids are encoded as uint32


# ---------------------------------------------------------------------------- errors


class BlockManagerError(Exception):
    """Base class of every error the block manager raises."""


class InvalidConfigError(BlockManagerError, ValueError):
    """Bad constructor argument (num_blocks < 1, block_size < 1, ...)."""


class InvalidArgumentError(BlockManagerError, HashInputError):
    """Bad argument to a method: empty prompt, bad token id, position out of range, ..."""


class UnknownSequenceError(BlockManagerError, LookupError):
    """The sequence was never allocated or was already freed (this covers a double free)."""


class SequenceExistsError(BlockManagerError):
    """`allocate` or `fork` with a sequence id that is already live."""


class NoFreeBlocksError(BlockManagerError):
    """Not enough allocatable blocks right now; the caller may wait, evict or preempt."""


class RequestTooLargeError(BlockManagerError):
    """The sequence needs more blocks than the whole pool has: it can never fit."""


# ---------------------------------------------------------------------------- events, stats


@dataclass(frozen=True)
class BlockStored:
    """A full block entered the prefix cache."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_id: int


@dataclass(frozen=True)
class BlockRemoved:
    """A cached block was evicted: its hash is gone from this manager."""

    block_hash: BlockHash
    block_id: int


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: the engine must copy the K/V of block `src` into block `dst`."""

    src: int
    dst: int


@dataclass
class BlockManagerStats:
    """Plain counters; the metrics exporter turns them into Prometheus series.

    num_free + num_cached_free + num_used == num_blocks.
    """

    num_blocks: int
    block_size: int
    num_used: int  # refcount >= 1
    num_cached_free: int  # refcount 0, hashed, evictable (LRU)
    num_free: int  # refcount 0, never cached (or evicted)
    num_cached: int  # hashes in the prefix cache (used or cached-free)
    num_seqs: int
    prefix_query_tokens: int  # prompt tokens looked up by `allocate`
    prefix_hit_tokens: int  # of those, found in the cache
    num_evictions: int
    num_stored: int  # blocks ever registered in the prefix cache
    num_cow_copies: int

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )


# ---------------------------------------------------------------------------- manager


class _Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: BlockHash | None = None  # set while the block is in the prefix cache
        self.token_ids: tuple[int, ...] | None = None  # set with hash, compared on a hit


@dataclass
class _Seq:
    """One sequence's blocks.

    Of its token ids only the tail is kept: the tokens of the blocks not hashed yet
    (from block len(hashes) on), which `mark_computed` hashes and then drops. A hashed
    block is known by its chained hash (and a cached one by its own `_Block.token_ids`),
    so a long sequence costs one partial block of ids here, not a second copy of all
    of them. (Why not point at the engine's `Sequence.token_ids` instead: pins, forks
    and swap-ins create block-manager sequences that have no such list, or whose list
    holds tokens without slots yet; an alias would tie the hashes to another module
    never mutating or sharing its list wrongly.)
    """

    num_tokens: int  # tokens that have a slot
    tail: list[int]  # token ids [len(hashes) * block_size, num_tokens)
    block_table: list[int]  # len == ceil(num_tokens / block_size)
    num_computed: int  # tokens [0, num_computed) have K/V in the cache
    hashes: list[BlockHash]  # chained hashes of the computed full blocks
    extra: bytes  # extra_key(model_id, cache_salt)

    def chunk(self, i: int, block_size: int) -> tuple[int, ...] | None:
        """The token ids of block i; None once hashed (only its hash is kept)."""
        j = i - len(self.hashes)
        return None if j < 0 else tuple(self.tail[j * block_size : (j + 1) * block_size])


class BlockManager:
    """Physical KV blocks, per-sequence block tables and the local prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        model_id: str = "",
        enable_prefix_caching: bool = True,
    ) -> None:
        _check_positive_int("num_blocks", num_blocks, InvalidConfigError)
        _check_positive_int("block_size", block_size, InvalidConfigError)
        if not isinstance(model_id, str):
            raise InvalidConfigError(f"model_id must be a str, got {type(model_id).__name__}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_id = model_id
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._hash_to_block: dict[BlockHash, int] = {}
        self._seqs: dict[str, _Seq] = {}
        self._events: list[BlockStored | BlockRemoved] = []
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._num_evictions = 0
        self._num_stored = 0
        self._num_cow_copies = 0

    # ------------------------------------------------------------------ queries

    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus cached-free (evictable)."""
        return len(self._free) + len(self._cached_free)

    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks()

    def usage(self) -> float:
        """Fraction of blocks in use (refcount >= 1)."""
        return self.num_used_blocks() / self.num_blocks

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._seq(seq_id).block_table)

    def num_tokens(self, seq_id: str) -> int:
        """Tokens that have slots."""
        return self._seq(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: str) -> int:
        return self._seq(seq_id).num_computed

    def seq_block_hashes(self, seq_id: str) -> list[BlockHash]:
        """Chained hashes of the sequence's computed full blocks, in order."""
        return list(self._seq(seq_id).hashes)

    def block_ref_count(self, block_id: int) -> int:
        """How many block-table entries point at this physical block."""
        if not 0 <= block_id < self.num_blocks:
            raise InvalidArgumentError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return self._blocks[block_id].ref_count

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache now (used or cached-free), for an index resync."""
        return list(self._hash_to_block)

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Flat slots `block_id * block_size + offset` of positions [start, end)."""
        seq = self._seq(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise InvalidArgumentError(
                f"positions [{start}, {end}) out of range for sequence {seq_id!r} "
                f"with {seq.num_tokens} tokens"
            )
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading tokens whose full blocks are cached. A pure query.

        Never the whole prompt: at most `(len - 1) // block_size` blocks are matched, so
        at least one token is left to compute (it produces the next-token logits).
        """
        tokens = _as_token_ids(token_ids)
        return len(self._cached_prefix(tokens, extra_key(self.model_id, cache_salt))) * (
            self.block_size
        )

    def stats(self) -> BlockManagerStats:
        return BlockManagerStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_used=self.num_used_blocks(),
            num_cached_free=len(self._cached_free),
            num_free=len(self._free),
            num_cached=len(self._hash_to_block),
            num_seqs=len(self._seqs),
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            num_evictions=self._num_evictions,
            num_stored=self._num_stored,
            num_cow_copies=self._num_cow_copies,
        )

    def drain_events(self) -> list[BlockStored | BlockRemoved]:
        """Cache events since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ allocate

    def can_allocate(self, token_ids: Sequence[int], cache_salt: str | None = None) -> bool:
        """Whether `allocate` would succeed now (False also when it can never fit)."""
        tokens = _as_prompt(token_ids)
        if self._blocks_for(len(tokens)) > self.num_blocks:
            return False
        hits = self._cached_prefix(tokens, extra_key(self.model_id, cache_salt))
        return self._blocks_to_take(hits, len(tokens)) <= self.num_free_blocks()

    def allocate(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Create `seq_id` with slots for `token_ids`; return how many are already cached.

        # [0, num_cached)          shared cached prefix blocks (refcount++)
        # [num_cached, len)        fresh blocks, K/V still to compute
        The cached tokens are the sequence's initial `num_computed_tokens`.
        """
        if seq_id in self._seqs:
            raise SequenceExistsError(f"sequence {seq_id!r} already exists")
        tokens = _as_prompt(token_ids)
        num_needed = self._blocks_for(len(tokens))
        if num_needed > self.num_blocks:
            raise RequestTooLargeError(
                f"sequence {seq_id!r} needs {num_needed} blocks ({len(tokens)} tokens at "
                f"block_size {self.block_size}) but the pool has only {self.num_blocks}"
            )
        extra = extra_key(self.model_id, cache_salt)
        hits = self._cached_prefix(tokens, extra)
        num_take = self._blocks_to_take(hits, len(tokens))
        if num_take > self.num_free_blocks():
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {num_take} free blocks, "
                f"{self.num_free_blocks()} allocatable"
            )
        # Hits first: reviving them from the LRU keeps the fresh-block path from evicting them.
        table = [self._ref_cached(block_id) for block_id, _ in hits]
        table += [self._take_free_block() for _ in range(num_needed - len(hits))]
        num_cached = len(hits) * self.block_size
        hashes = [h for _, h in hits]
        tail = tokens[num_cached:]
        self._seqs[seq_id] = _Seq(len(tokens), tail, table, num_cached, hashes, extra)
        self._prefix_query_tokens += len(tokens)
        self._prefix_hit_tokens += num_cached
        return num_cached

    def acquire_cached_prefix(
        self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> int:
        """Pin the longest cached chain of full blocks of `token_ids` under a new sequence.

        For exporting a prefix to another worker: every full block may match (there
        is nothing to compute), no fresh block is taken, and the sequence is fully
        computed. Returns the tokens pinned; 0 creates no sequence. `free` unpins.
        """
        if seq_id in self._seqs:
            raise SequenceExistsError(f"sequence {seq_id!r} already exists")
        tokens = _as_prompt(token_ids)
        extra = extra_key(self.model_id, cache_salt)
        hits = self._cached_prefix(tokens, extra, leave_one=False)
        if not hits:
            return 0
        n = len(hits) * self.block_size
        table = [self._ref_cached(block_id) for block_id, _ in hits]
        self._seqs[seq_id] = _Seq(n, [], table, n, [h for _, h in hits], extra)
        return n

    def mark_computed(self, seq_id: str, num_tokens: int) -> None:
        """Tokens [0, num_tokens) now have K/V; their full blocks enter the prefix cache."""
        seq = self._seq(seq_id)
        _check_non_negative("num_tokens", num_tokens)
        if not seq.num_computed <= num_tokens <= seq.num_tokens:
            raise InvalidArgumentError(
                f"mark_computed({seq_id!r}, {num_tokens}): must lie in "
                f"[{seq.num_computed} computed, {seq.num_tokens} tokens]"
            )
        seq.num_computed = num_tokens
        bs = self.block_size
        first = len(seq.hashes)
        for i in range(first, num_tokens // bs):
            parent = seq.hashes[-1] if seq.hashes else None
            chunk = tuple(seq.tail[(i - first) * bs : (i - first + 1) * bs])
            block_hash = hash_block(parent, chunk, seq.extra)
            seq.hashes.append(block_hash)
            if self.enable_prefix_caching:
                self._cache_block(seq.block_table[i], block_hash, parent, chunk)
        del seq.tail[: (len(seq.hashes) - first) * bs]  # hashed: the hash stands for them

    # ------------------------------------------------------------------ append, fork

    def can_append(self, seq_id: str, num_tokens: int = 1) -> bool:
        seq = self._seq(seq_id)
        _check_non_negative("num_tokens", num_tokens)
        cow, num_new = self._append_plan(seq, num_tokens)
        return (
            len(seq.block_table) + num_new <= self.num_blocks
            and cow + num_new <= self.num_free_blocks()
        )

    def append_tokens(self, seq_id: str, token_ids: Sequence[int]) -> list[BlockCopy]:
        """Give new tokens slots (their K/V is about to be computed).

        A new block is taken only when the last one is full. If the last block is partial
        and shared (after `fork`), it is copied first; the copy is returned so the engine
        copies its K/V before writing.
        """
        seq = self._seq(seq_id)
        tokens = _as_token_ids(token_ids)
        cow, num_new = self._append_plan(seq, len(tokens))
        if len(seq.block_table) + num_new > self.num_blocks:
            raise RequestTooLargeError(
                f"sequence {seq_id!r} would need {len(seq.block_table) + num_new} blocks "
                f"but the pool has only {self.num_blocks}"
            )
        if cow + num_new > self.num_free_blocks():
            raise NoFreeBlocksError(
                f"appending {len(tokens)} tokens to {seq_id!r} needs {cow + num_new} free "
                f"blocks, {self.num_free_blocks()} allocatable"
            )
        copies = []
        if cow:
            copies.append(self._copy_on_write(seq))
        seq.block_table += [self._take_free_block() for _ in range(num_new)]
        seq.tail += tokens
        seq.num_tokens += len(tokens)
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent: same tokens, same computed prefix."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise SequenceExistsError(f"cannot fork into {child_id!r}: it already exists")
        for block_id in parent.block_table:
            self._blocks[block_id].ref_count += 1
        self._seqs[child_id] = _Seq(
            parent.num_tokens,
            list(parent.tail),
            list(parent.block_table),
            parent.num_computed,
            list(parent.hashes),
            parent.extra,
        )

    # ------------------------------------------------------------------ free, evict

    def free(self, seq_id: str) -> None:
        """Release every block of the sequence at once, tail first."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequenceError(f"cannot free {seq_id!r}: unknown or already freed")
        for block_id in reversed(seq.block_table):
            self._release(block_id)

    def evict(self, num_blocks: int | None = None) -> int:
        """Evict up to `num_blocks` cached-free blocks (all if None), LRU first."""
        if num_blocks is not None:
            _check_non_negative("num_blocks", num_blocks)
        count = len(self._cached_free)
        if num_blocks is not None:
            count = min(count, num_blocks)
        for _ in range(count):
            self._free.append(self._evict_lru())
        return count

    # ------------------------------------------------------------------ internals

    def _seq(self, seq_id: str) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r} (never allocated or freed)")
        return seq

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cached_prefix(
        self, tokens: list[int], extra: bytes, leave_one: bool = True
    ) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the longest cached chain of full blocks.

        leave_one: stop before the last token, so a prompt always computes >= 1 token.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[tuple[int, BlockHash]] = []
        parent = None
        for i in range((len(tokens) - 1 if leave_one else len(tokens)) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            block_hash = hash_block(parent, chunk, extra)
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None or self._blocks[block_id].token_ids != chunk:
                break
            hits.append((block_id, block_hash))
            parent = block_hash
        return hits

    def _blocks_to_take(self, hits: list[tuple[int, BlockHash]], num_tokens: int) -> int:
        """Allocatable blocks a prompt consumes: fresh ones plus hits revived from the LRU."""
        revived = sum(1 for block_id, _ in hits if self._blocks[block_id].ref_count == 0)
        return self._blocks_for(num_tokens) - len(hits) + revived

    def _append_plan(self, seq: _Seq, num_tokens: int) -> tuple[int, int]:
        """(copy-on-write blocks 0/1, new blocks) needed to append `num_tokens`."""
        num_new = self._blocks_for(seq.num_tokens + num_tokens) - len(seq.block_table)
        last_partial = seq.num_tokens % self.block_size != 0
        shared = self._blocks[seq.block_table[-1]].ref_count > 1
        return int(num_tokens > 0 and last_partial and shared), num_new

    def _copy_on_write(self, seq: _Seq) -> BlockCopy:
        src = seq.block_table[-1]
        dst = self._take_free_block()
        self._blocks[src].ref_count -= 1  # still >= 1: it was shared
        seq.block_table[-1] = dst
        self._num_cow_copies += 1
        return BlockCopy(src, dst)

    def _ref_cached(self, block_id: int) -> int:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._cached_free[block_id]
        block.ref_count += 1
        return block_id

    def _take_free_block(self) -> int:
        """A never-cached free block if any, else the LRU cached-free block (evicted)."""
        block_id = self._free.popleft() if self._free else self._evict_lru()
        self._blocks[block_id].ref_count = 1
        return block_id

    def _evict_lru(self) -> int:
        block_id, _ = self._cached_free.popitem(last=False)
        block = self._blocks[block_id]
        assert block.hash is not None
        del self._hash_to_block[block.hash]
        self._events.append(BlockRemoved(block.hash, block_id))
        block.hash = None
        block.token_ids = None
        self._num_evictions += 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.hash is not None:
            self._cached_free[block_id] = None  # most recently used end
        else:
            self._free.append(block_id)

    def _cache_block(
        self, block_id: int, block_hash: BlockHash, parent: BlockHash | None, chunk: tuple
    ) -> None:
        block = self._blocks[block_id]
        if block.hash is not None:  # shared after fork and already cached by a sharer
            return
        if block_hash in self._hash_to_block:  # same content lives in another block
            return
        block.hash = block_hash
        block.token_ids = chunk
        self._hash_to_block[block_hash] = block_id
        self._events.append(BlockStored(block_hash, parent, chunk, block_id))
        self._num_stored += 1

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        self._check_pools()
        self._check_refcounts()
        self._check_hash_map()
        for seq_id, seq in self._seqs.items():
            self._check_seq(seq_id, seq)

    def _check_pools(self) -> None:
        free, cached = set(self._free), set(self._cached_free)
        _require(len(free) == len(self._free), "a block appears twice in the free list")
        _require(not free & cached, f"blocks both free and cached-free: {sorted(free & cached)}")
        for block in self._blocks:
            in_pool = block.block_id in free or block.block_id in cached
            _require(
                in_pool == (block.ref_count == 0),
                f"block {block.block_id}: refcount {block.ref_count} but "
                f"{'in' if in_pool else 'not in'} free/cached-free",
            )
            _require(block.ref_count >= 0, f"block {block.block_id}: negative refcount")
        for block_id in free:
            _require(self._blocks[block_id].hash is None, f"free block {block_id} has a hash")
        for block_id in cached:
            _require(self._blocks[block_id].hash is not None, f"cached-free {block_id} unhashed")

    def _check_refcounts(self) -> None:
        refs = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            _require(
                len(set(seq.block_table)) == len(seq.block_table),
                f"sequence {seq_id!r}: a block appears twice in its table",
            )
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self._blocks:
            _require(
                refs[block.block_id] == block.ref_count,
                f"block {block.block_id}: refcount {block.ref_count} but "
                f"{refs[block.block_id]} table entries",
            )

    def _check_hash_map(self) -> None:
        if not self.enable_prefix_caching:
            _require(not self._hash_to_block, "prefix caching is off but hashes are cached")
        for block_hash, block_id in self._hash_to_block.items():
            _require(
                self._blocks[block_id].hash == block_hash,
                f"hash map points {block_hash.hex()} at block {block_id} with another hash",
            )
        for block in self._blocks:
            if block.hash is None:
                _require(block.token_ids is None, f"block {block.block_id}: tokens, no hash")
                continue
            _require(
                self._hash_to_block.get(block.hash) == block.block_id,
                f"block {block.block_id} has a hash the map does not point back to it",
            )
            _require(
                block.token_ids is not None and len(block.token_ids) == self.block_size,
                f"cached block {block.block_id} is not full",
            )

    def _check_seq(self, seq_id: str, seq: _Seq) -> None:
        bs = self.block_size
        _require(
            len(seq.block_table) == self._blocks_for(seq.num_tokens),
            f"sequence {seq_id!r}: {len(seq.block_table)} blocks for {seq.num_tokens} tokens",
        )
        _require(
            0 <= seq.num_computed <= seq.num_tokens,
            f"sequence {seq_id!r}: {seq.num_computed} computed > {seq.num_tokens} tokens",
        )
        _require(
            len(seq.tail) == seq.num_tokens - len(seq.hashes) * bs,
            f"sequence {seq_id!r}: {len(seq.tail)} tail tokens past {len(seq.hashes)} hashes",
        )
        _require(
            len(seq.hashes) == seq.num_computed // bs,
            f"sequence {seq_id!r}: {len(seq.hashes)} hashes for {seq.num_computed} computed",
        )
        for i, block_id in enumerate(seq.block_table):
            block = self._blocks[block_id]
            chunk = seq.chunk(i, bs)  # None: hashed by this sequence, only the hash is kept
            if block.hash is not None:
                # A fork sharer may have computed (and cached) a block that this sequence
                # has not marked computed yet: then only the token ids can be compared.
                _require(
                    i >= len(seq.hashes) or seq.hashes[i] == block.hash,
                    f"sequence {seq_id!r}: cached block {block_id} at index {i} has another hash",
                )
                if chunk is None:  # the block's own tokens must give the hash we computed
                    parent = seq.hashes[i - 1] if i else None
                    same = hash_block(parent, block.token_ids or (), seq.extra) == seq.hashes[i]
                else:
                    same = block.token_ids == chunk
                _require(same, f"sequence {seq_id!r}: cached block {block_id} holds other tokens")
            if block.ref_count > 1 and chunk is not None and len(chunk) < bs:
                # A shared partial block is only ever shared by forks that wrote nothing
                # since: every sharer must see exactly the same tokens in it.
                for other_id, other in self._seqs.items():
                    if block_id in other.block_table:
                        j = other.block_table.index(block_id)
                        _require(
                            j == i and other.chunk(j, bs) == chunk,
                            f"shared block {block_id} differs between {seq_id!r} and {other_id!r}",
                        )


# ---------------------------------------------------------------------------- helpers


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _check_positive_int(name: str, value: object, error: type[Exception]) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise error(f"{name} must be a positive int, got {value!r}")


def _check_non_negative(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")


def _as_token_ids(token_ids: Sequence[int]) -> list[int]:
    """A fresh list of Python ints in [0, 2**32), or InvalidArgumentError."""
    try:
        tokens = list(map(operator.index, token_ids))
    except TypeError:
        raise InvalidArgumentError(
            f"token ids must be a sequence of ints, got {type(token_ids).__name__}"
        ) from None
    if tokens and (min(tokens) < 0 or max(tokens) > MAX_TOKEN_ID):
        raise InvalidArgumentError(
            f"token ids must lie in [0, 2**32), got min {min(tokens)} max {max(tokens)}"
        )
    return tokens


def _as_prompt(token_ids: Sequence[int]) -> list[int]:
    tokens = _as_token_ids(token_ids)
    if not tokens:
        raise InvalidArgumentError("a sequence needs at least one token")
    return tokens
