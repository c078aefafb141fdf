"""Property test: random allocate / append / fork / free / evict / mark_computed.

Besides `check_integrity()` after every step, the machine keeps a model of what an engine
would see: `kv[slot]` is the token whose K/V a slot holds, written on `mark_computed` and
moved on every copy-on-write. The strongest invariant follows: every computed position
of every live sequence finds its own token's K/V in its slot, whatever was shared,
cached, evicted or copied. A second model replays the events and must equal the cache.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.common.core.block_manager import (
    BlockManager,
    BlockRemoved,
    BlockStored,
    NoFreeBlocksError,
    RequestTooLargeError,
    UnknownSequenceError,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 12
# A few shared beginnings plus a random tail over a 2-token alphabet: prefixes collide
# often, so hits, revivals, private duplicates and evictions all happen.
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1, 2]]
prompts = st.builds(
    lambda prefix, tail: prefix + tail,
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 1), min_size=1, max_size=10),
)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, model_id="prop")
        self.tokens: dict[str, list[int]] = {}
        self.kv: dict[int, int] = {}  # slot -> token whose K/V it holds
        self.cached: set[bytes] = set()  # replay of the events
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def _pick(self, index: int) -> str:
        live = sorted(self.tokens)
        return live[index % len(live)]

    def _snapshot(self) -> tuple:
        return (self.bm.stats(), sorted(self.bm.cached_hashes()), self.bm.num_free_blocks())

    # ------------------------------------------------------------------ rules

    @rule(prompt=prompts, salt=st.sampled_from([None, None, "t"]))
    def allocate(self, prompt: list[int], salt: str | None) -> None:
        seq_id = self._new_id()
        expected_cached = self.bm.match_prefix(prompt, cache_salt=salt)
        if not self.bm.can_allocate(prompt, cache_salt=salt):
            before = self._snapshot()
            try:
                self.bm.allocate(seq_id, prompt, cache_salt=salt)
            except (NoFreeBlocksError, RequestTooLargeError):
                pass
            else:
                raise AssertionError("allocate succeeded although can_allocate said no")
            assert self._snapshot() == before
            assert not self.bm.has_seq(seq_id)
            return
        cached = self.bm.allocate(seq_id, prompt, cache_salt=salt)
        assert cached == expected_cached
        assert cached % BLOCK_SIZE == 0 and cached < len(prompt)
        assert self.bm.num_computed_tokens(seq_id) == cached
        self.tokens[seq_id] = list(prompt)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 100), new=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def append(self, index: int, new: list[int]) -> None:
        seq_id = self._pick(index)
        table = self.bm.block_table(seq_id)
        n = len(self.tokens[seq_id])
        last_shared = self.bm.block_ref_count(table[-1]) > 1
        if not self.bm.can_append(seq_id, len(new)):
            before = self._snapshot()
            try:
                self.bm.append_tokens(seq_id, new)
            except (NoFreeBlocksError, RequestTooLargeError):
                pass
            else:
                raise AssertionError("append succeeded although can_append said no")
            assert self._snapshot() == before
            return
        copies = self.bm.append_tokens(seq_id, new)
        if n % BLOCK_SIZE and last_shared:
            assert len(copies) == 1
            assert copies[0].src == table[-1]
            assert copies[0].dst == self.bm.block_table(seq_id)[len(table) - 1]
        else:
            assert copies == []
        for copy in copies:  # what the engine does with a BlockCopy
            for offset in range(BLOCK_SIZE):
                src = copy.src * BLOCK_SIZE + offset
                if src in self.kv:
                    self.kv[copy.dst * BLOCK_SIZE + offset] = self.kv[src]
        self.tokens[seq_id] += new
        assert self.bm.block_table(seq_id)[: len(table) - 1] == table[:-1]

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 100), fraction=st.floats(0, 1))
    def mark_computed(self, index: int, fraction: float) -> None:
        seq_id = self._pick(index)
        start = self.bm.num_computed_tokens(seq_id)
        end = start + round((len(self.tokens[seq_id]) - start) * fraction)
        for pos, slot in enumerate(self.bm.slot_mapping(seq_id, start, end), start):
            self.kv[slot] = self.tokens[seq_id][pos]  # the forward pass writes K/V
        self.bm.mark_computed(seq_id, end)
        assert self.bm.num_computed_tokens(seq_id) == end

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 100))
    def fork(self, index: int) -> None:
        parent = self._pick(index)
        child = self._new_id()
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        assert self.bm.block_table(child) == self.bm.block_table(parent)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        seq_id = self._pick(index)
        free_before = self.bm.num_free_blocks()
        exclusive = sum(self.bm.block_ref_count(b) == 1 for b in self.bm.block_table(seq_id))
        self.bm.free(seq_id)
        del self.tokens[seq_id]
        assert self.bm.num_free_blocks() == free_before + exclusive
        try:
            self.bm.free(seq_id)
        except UnknownSequenceError:
            pass
        else:
            raise AssertionError("double free was accepted")

    @rule(count=st.one_of(st.none(), st.integers(0, 4)))
    def evict(self, count: int | None) -> None:
        cached_free = self.bm.stats().num_cached_free
        evicted = self.bm.evict(count)
        assert evicted == (cached_free if count is None else min(count, cached_free))

    # ------------------------------------------------------------------ invariants

    @invariant()
    def integrity(self) -> None:
        self.bm.check_integrity()
        stats = self.bm.stats()
        assert stats.num_free + stats.num_cached_free + stats.num_used == NUM_BLOCKS
        assert stats.num_seqs == len(self.tokens)

    @invariant()
    def computed_positions_hold_their_own_kv(self) -> None:
        for seq_id, tokens in self.tokens.items():
            assert self.bm.num_tokens(seq_id) == len(tokens)
            computed = self.bm.num_computed_tokens(seq_id)
            for pos, slot in enumerate(self.bm.slot_mapping(seq_id, 0, computed)):
                assert self.kv.get(slot) == tokens[pos], (seq_id, pos, slot)

    @invariant()
    def events_replay_to_the_cache(self) -> None:
        for event in self.bm.drain_events():
            if isinstance(event, BlockStored):
                assert event.block_hash not in self.cached
                self.cached.add(event.block_hash)
            else:
                assert isinstance(event, BlockRemoved)
                self.cached.remove(event.block_hash)
        assert self.cached == set(self.bm.cached_hashes())


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
