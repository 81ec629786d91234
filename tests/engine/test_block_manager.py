"""BlockManager: ref counts, the prefix cache, LRU eviction, fork with copy-on-write, and a stateful
model that simulates the KV writes and reads every live sequence back through its block table."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.block_manager import BlockManager, block_hash
from engine.sampling_params import SamplingParams
from engine.sequence import Request, Sequence

BS = 4  # block size everywhere in this file

# A slot's simulated KV is the whole token history up to and including its position, as the real KV
# of a position depends on every token before it: a block reused under the wrong prefix reads wrong.
Slot = tuple[int, ...]


def make_seq(token_ids: list[int], index: int = 0) -> Sequence:
    request = Request(f"r{index}", list(token_ids), SamplingParams(), max_tokens=16, eos_token_ids=frozenset())
    return Sequence(request, index, list(token_ids), seed=0)


def chain_hashes(token_ids: list[int], num_blocks: int) -> list[bytes]:
    hashes = [b""]
    for i in range(num_blocks):
        hashes.append(block_hash(hashes[-1], token_ids[i * BS : (i + 1) * BS]))
    return hashes[1:]


def snapshot(bm: BlockManager, *seqs: Sequence) -> tuple:
    """Everything allocate_slots may touch, to prove a failed call changed nothing."""
    return (
        list(bm.free_ids),
        list(bm.evictable),
        dict(bm.cached),
        [(b.ref_count, b.hash) for b in bm.blocks],
        list(bm.pending_copies),
        bm.prefix_queries,
        bm.prefix_hits,
        [(list(s.block_table), s.num_computed_tokens) for s in seqs],
    )


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """What the scheduler does on admission, then the step's forward over the whole rest: the hits."""
    hits = bm.match_prefix(seq)
    num_cached = len(hits) * BS
    num_new = seq.num_tokens - num_cached
    assert bm.allocate_slots(seq, num_new, hits)
    seq.num_computed_tokens = num_cached
    step_done(bm, seq, num_new)
    return hits


def step(bm: BlockManager, seq: Sequence, num_new: int) -> None:
    assert bm.allocate_slots(seq, num_new)
    step_done(bm, seq, num_new)


def step_done(bm: BlockManager, seq: Sequence, num_new: int) -> None:
    old = seq.num_computed_tokens
    seq.num_computed_tokens += num_new
    bm.cache_full_blocks(seq, old)


# ---------------------------------------------------------------------------------------------------
# Plain tests


def test_hit_reuses_block_ids_and_counts_tokens() -> None:
    bm = BlockManager(16, BS)
    a = make_seq(list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(bm, a) == []
    assert (bm.prefix_queries, bm.prefix_hits) == (10, 0)
    b = make_seq(list(range(8)) + [50, 51, 52])  # shares a's two full blocks
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert (bm.prefix_queries, bm.prefix_hits) == (10 + 11, 8)
    b.token_ids.append(53)
    step(bm, b, 1)  # a decode step is no lookup
    assert (bm.prefix_queries, bm.prefix_hits) == (10 + 11, 8)
    # A different first block breaks the chain even though the second block's tokens match a's.
    c = make_seq([99, 1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.match_prefix(c) == []


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(12))  # exactly 3 full blocks
    a = make_seq(prompt)
    admit(bm, a)
    assert len(bm.cached) == 3
    b = make_seq(prompt)
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]  # k - 1 hits: the last block holds the token to sample from
    assert bm.allocate_slots(b, 4, hits)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert (bm.prefix_queries, bm.prefix_hits) == (24, 8)
    # One more token: the third block is now before the last token and is a hit.
    assert bm.match_prefix(make_seq(prompt + [7])) == a.block_table


def test_freed_cached_blocks_are_evicted_lru_tail_first() -> None:
    bm = BlockManager(6, BS)
    a, b = make_seq([1] * 8 + [0]), make_seq([2] * 8 + [0])  # 2 cached full blocks + 1 partial each
    admit(bm, a)
    admit(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    # Partial blocks hold nothing cached; full ones wait, oldest free first, each sequence tail first.
    assert list(bm.free_ids) == [a_blocks[2], b_blocks[2]]
    assert list(bm.evictable) == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    assert a.block_table == [] and bm.num_free_blocks == 6 and bm.num_used_blocks == 0

    c = make_seq([3] * 16)
    assert bm.allocate_slots(c, 16)  # 4 blocks: the 2 uncached ones, then a's tail, then a's head
    assert c.block_table == [a_blocks[2], b_blocks[2], a_blocks[1], a_blocks[0]]
    assert list(bm.evictable) == b_blocks[1::-1]
    assert set(bm.cached.values()) == set(b_blocks[:2])
    assert all(bm.blocks[i].hash is None for i in a_blocks[:2])
    assert bm.match_prefix(make_seq([1] * 9)) == []
    assert bm.match_prefix(make_seq([2] * 9)) == b_blocks[:2]


def test_partly_evicted_prefix_still_hits_on_its_head() -> None:
    """Tail-first freeing: eviction eats a freed prefix from its end, so what is left still hits."""
    bm = BlockManager(4, BS)
    prompt = [1] * 12 + [0]
    a = make_seq(prompt)
    admit(bm, a)  # 3 cached blocks + 1 partial: the whole pool
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.match_prefix(make_seq(prompt)) == a_blocks[:3]
    assert bm.allocate_slots(make_seq([5, 5]), 2)  # takes the free partial block: no eviction
    assert bm.match_prefix(make_seq(prompt)) == a_blocks[:3]
    assert bm.allocate_slots(make_seq([6, 6]), 2)  # evicts a's last full block
    assert bm.match_prefix(make_seq(prompt)) == a_blocks[:2]


def test_hit_revives_an_evictable_block_instead_of_evicting_it() -> None:
    bm = BlockManager(4, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert list(bm.evictable) == [a_blocks[1], a_blocks[0]]
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8] + list(range(20, 29)))
    hits = bm.match_prefix(b)
    assert hits == a_blocks[:2]
    # The other 9 tokens need 3 fresh blocks: 4 count as free, but 2 of those are the hits.
    assert bm.num_free_blocks == 4
    before = snapshot(bm, b)
    assert not bm.allocate_slots(b, 9, hits)
    assert snapshot(bm, b) == before
    assert bm.allocate_slots(b, 5, hits)  # a chunk that needs 2
    assert b.block_table[:2] == a_blocks[:2]
    assert len(bm.evictable) == 0 and len(bm.free_ids) == 0
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table)
    assert set(bm.cached.values()) == set(a_blocks[:2])  # still cached, now referenced


def test_fork_then_append_copies_on_write_once_per_writer() -> None:
    bm = BlockManager(8, BS)
    parent = make_seq([1, 2, 3, 4, 5, 6])  # 1 full block + a partial one
    admit(bm, parent)
    full, partial = parent.block_table
    child = make_seq(parent.token_ids, index=1)
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    assert child.block_table == [full, partial]
    assert bm.blocks[full].ref_count == 2 and bm.blocks[partial].ref_count == 2

    parent.token_ids.append(7)
    step(bm, parent, 1)  # writes into the shared partial block: a private copy first
    assert parent.block_table[0] == full and parent.block_table[1] not in (full, partial)
    assert bm.take_copies() == [(partial, parent.block_table[1])]
    assert bm.blocks[partial].ref_count == 1 and bm.blocks[full].ref_count == 2

    parent.token_ids.append(8)
    step(bm, parent, 1)  # its own block now: no second copy
    assert bm.take_copies() == []

    child.token_ids.append(70)
    step(bm, child, 1)  # the last sharer writes in place
    assert child.block_table == [full, partial]
    assert bm.take_copies() == []
    assert bm.blocks[partial].ref_count == 1

    # The parent filled its copy: that block is cached; the child's differs, so it is not.
    assert bm.blocks[parent.block_table[1]].hash is not None
    assert bm.blocks[partial].hash is None
    bm.free(parent)
    bm.free(child)
    assert bm.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    bm = BlockManager(8, BS)
    parent = make_seq([1, 2, 3, 4, 5, 6, 7, 8])
    admit(bm, parent)
    child = make_seq(parent.token_ids, index=1)
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    for seq, token in ((parent, 9), (child, 10)):
        seq.token_ids.append(token)
        step(bm, seq, 1)
    assert bm.take_copies() == []
    assert parent.block_table[:2] == child.block_table[:2]
    assert parent.block_table[2] != child.block_table[2]
    assert [bm.blocks[i].ref_count for i in parent.block_table[:2]] == [2, 2]


def test_failed_allocation_returns_false_and_changes_nothing() -> None:
    bm = BlockManager(3, BS)
    a = make_seq([1, 2, 3, 4, 5, 6])
    admit(bm, a)
    child = make_seq(a.token_ids, index=1)
    bm.fork(a, child)
    child.num_computed_tokens = a.num_computed_tokens
    a.token_ids += [7, 8, 9, 10, 11, 12]
    # One new block would fit the one free block, but the shared partial block needs a copy too.
    assert bm.num_free_blocks == 1
    before = snapshot(bm, a, child)
    assert not bm.allocate_slots(a, 6)
    assert snapshot(bm, a, child) == before
    assert bm.allocate_slots(a, 2)  # fills the partial block: the copy alone
    assert len(bm.take_copies()) == 1 and bm.num_free_blocks == 0

    # A failing admission with hits leaves the hits evictable and the counters alone.
    bm = BlockManager(3, BS)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    b = make_seq([1, 2, 3, 4] + [9] * 9)
    hits = bm.match_prefix(b)
    assert len(hits) == 1
    before = snapshot(bm, b)
    assert not bm.allocate_slots(b, 9, hits)
    assert snapshot(bm, b) == before
    assert bm.blocks[hits[0]].hash is not None and hits[0] in bm.evictable


def test_prefix_caching_off() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    admit(bm, a)
    assert bm.cached == {} and all(b.hash is None for b in bm.blocks)
    bm.free(a)
    assert bm.match_prefix(make_seq(list(range(9)))) == []
    assert len(bm.free_ids) == 8 and len(bm.evictable) == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)


def test_double_free_is_caught() -> None:
    bm = BlockManager(4, BS)
    a = make_seq([1, 2, 3])
    admit(bm, a)
    stale = make_seq([1, 2, 3])
    stale.block_table = list(a.block_table)
    bm.free(a)
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(stale)


# ---------------------------------------------------------------------------------------------------
# Stateful model

PROMPT_BASES = ([0, 1, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0], [2] * 12)
prompts = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(PROMPT_BASES),
    st.integers(1, 12),
    st.lists(st.integers(0, 2), max_size=6),
)


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager the way the scheduler does and simulates the KV cache beside it: each
    computed token is written into its slot, pending copies are applied before the writes, and every
    live sequence must read its own history back through its block table."""

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager
        self.kv: dict[int, list[Slot | None]] = {}
        self.live: list[Sequence] = []  # hold blocks (running)
        self.waiting: list[Sequence] = []  # hold none: never admitted, preempted, or refused
        self.hash_history: dict[bytes, tuple[int, ...]] = {}  # a chained hash -> the tokens it covers
        self.next_index = 0

    @initialize(num_blocks=st.integers(8, 24), prefix_caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_blocks: int, prefix_caching: bool) -> None:
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
        self.kv = {i: [None] * BS for i in range(num_blocks)}

    # -- the scheduler's moves ------------------------------------------------------------------

    @rule(token_ids=prompts, chunk=st.integers(1, 20))
    def add(self, token_ids: list[int], chunk: int) -> None:
        self.next_index += 1
        seq = make_seq(token_ids, index=self.next_index)
        self.waiting.append(seq)
        self._admit(seq, chunk)

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 99), chunk=st.integers(1, 20))
    def readmit(self, i: int, chunk: int) -> None:
        self._admit(self.waiting[i % len(self.waiting)], chunk)

    @precondition(lambda self: any(s.num_computed_tokens < s.num_tokens for s in self.live))
    @rule(i=st.integers(0, 99), k=st.integers(1, 20))
    def compute(self, i: int, k: int) -> None:
        pending = [s for s in self.live if s.num_computed_tokens < s.num_tokens]
        seq = pending[i % len(pending)]
        self._step(seq, min(k, seq.num_tokens - seq.num_computed_tokens))

    @precondition(lambda self: any(s.num_computed_tokens == s.num_tokens for s in self.live))
    @rule(i=st.integers(0, 99), token=st.integers(0, 2))
    def append_token(self, i: int, token: int) -> None:
        done = [s for s in self.live if s.num_computed_tokens == s.num_tokens]
        done[i % len(done)].token_ids.append(token)

    @precondition(lambda self: any(s.num_computed_tokens == s.num_tokens for s in self.live))
    @rule(i=st.integers(0, 99), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def decode(self, i: int, tokens: list[int]) -> None:
        """A few decode steps in a row: sample a token, compute it in the next step."""
        done = [s for s in self.live if s.num_computed_tokens == s.num_tokens]
        seq = done[i % len(done)]
        for token in tokens:
            seq.token_ids.append(token)
            if not self._step(seq, 1):
                break

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def fork(self, i: int) -> None:
        parent = self.live[i % len(self.live)]
        self.next_index += 1
        child = make_seq(parent.token_ids, index=self.next_index)
        used = self.bm.num_used_blocks
        self.bm.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        assert child.block_table == parent.block_table and child.block_table is not parent.block_table
        assert self.bm.num_used_blocks == used  # sharing takes no block
        self.live.append(child)

    @precondition(lambda self: self.live or self.waiting)
    @rule(i=st.integers(0, 99))
    def finish(self, i: int) -> None:
        seqs = self.live + self.waiting
        seq = seqs[i % len(seqs)]
        self._free(seq)
        (self.live if seq in self.live else self.waiting).remove(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def preempt(self, i: int) -> None:
        seq = self.live.pop(i % len(self.live))
        self._free(seq)
        seq.num_computed_tokens = 0
        self.waiting.append(seq)

    # -- helpers --------------------------------------------------------------------------------

    def _admit(self, seq: Sequence, chunk: int) -> None:
        hits = self.bm.match_prefix(seq)
        self._check_prefix(seq, hits)
        num_cached = len(hits) * BS
        assert num_cached < seq.num_tokens  # the last token is always computed
        if self._allocate(seq, min(chunk, seq.num_tokens - num_cached), hits):
            self.waiting.remove(seq)
            self.live.append(seq)

    def _step(self, seq: Sequence, k: int) -> bool:
        return self._allocate(seq, k, [])

    def _check_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Hits are the longest run of leading blocks found in the cache under seq's tokens."""
        expected = []
        for h in chain_hashes(seq.token_ids, (seq.num_tokens - 1) // BS):
            if h not in self.bm.cached:
                break
            expected.append(self.bm.cached[h])
        assert hits == (expected if self.bm.enable_prefix_caching else [])

    def _allocate(self, seq: Sequence, k: int, hits: list[int]) -> bool:
        """allocate_slots, checked against the model; on success the step's forward follows."""
        bm = self.bm
        before = snapshot(bm, seq)
        table = list(seq.block_table)
        num_computed = seq.num_computed_tokens + len(hits) * BS
        revived = [b for b in hits if bm.blocks[b].ref_count == 0]
        shared_partial = bool(table and num_computed % BS and bm.blocks[table[-1]].ref_count > 1)
        need = bm.blocks_for(num_computed + k) - len(table) - len(hits) + shared_partial
        # Fresh blocks come from the free list first, then from the evictable ones, LRU first.
        free_before = list(bm.free_ids)
        evictable_left = [b for b in bm.evictable if b not in revived]
        if not bm.allocate_slots(seq, k, hits):
            assert snapshot(bm, seq) == before
            assert need > bm.num_free_blocks - len(revived)  # refused only when it really does not fit
            return False
        taken = seq.block_table[len(table) + len(hits) :]
        if shared_partial:
            taken.insert(0, seq.block_table[len(table) - 1])
            assert seq.block_table[: len(table) - 1] == table[:-1]
        else:
            assert seq.block_table[: len(table)] == table
        assert seq.block_table[len(table) : len(table) + len(hits)] == hits
        assert taken == (free_before + evictable_left)[:need]
        assert list(bm.evictable) == evictable_left[max(need - len(free_before), 0) :]
        queries, hit_tokens = before[5], before[6]
        if bm.enable_prefix_caching and not table:  # an admission is one lookup
            queries, hit_tokens = queries + seq.num_tokens, hit_tokens + len(hits) * BS
        assert (bm.prefix_queries, bm.prefix_hits) == (queries, hit_tokens)
        seq.num_computed_tokens = num_computed
        self._write(seq, k)
        return True

    def _write(self, seq: Sequence, k: int) -> None:
        """The forward pass: copy-on-write copies first, then the new tokens' KV into their slots."""
        for src, dst in self.bm.take_copies():
            assert self.bm.blocks[dst].ref_count == 1 and self.bm.blocks[dst].hash is None
            self.kv[dst] = list(self.kv[src])
        assert len(seq.block_table) == self.bm.blocks_for(seq.num_computed_tokens + k)
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + k):
            block = self.bm.blocks[seq.block_table[pos // BS]]
            # Writing into a block another sequence reads, or that the cache serves, corrupts it.
            assert block.ref_count == 1, f"write into shared block {block.block_id}"
            assert block.hash is None, f"write into cached block {block.block_id}"
            self.kv[block.block_id][pos % BS] = tuple(seq.token_ids[: pos + 1])
        old = seq.num_computed_tokens
        seq.num_computed_tokens += k
        self.bm.cache_full_blocks(seq, old)
        hashes = chain_hashes(seq.token_ids, seq.num_computed_tokens // BS)
        for i in range(old // BS, len(hashes)):
            self.hash_history.setdefault(hashes[i], tuple(seq.token_ids[: (i + 1) * BS]))
            if self.bm.enable_prefix_caching:  # every block the step filled is now findable
                assert hashes[i] in self.bm.cached

    def _free(self, seq: Sequence) -> None:
        """free, checked: blocks that drop to no reference join the back of their queue, tail first."""
        bm, table = self.bm, list(seq.block_table)
        free_before, evictable_before = list(bm.free_ids), list(bm.evictable)
        bm.free(seq)
        assert seq.block_table == []
        released = [b for b in reversed(table) if bm.blocks[b].ref_count == 0]
        assert list(bm.free_ids) == free_before + [b for b in released if bm.blocks[b].hash is None]
        assert list(bm.evictable) == evictable_before + [b for b in released if bm.blocks[b].hash is not None]

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        bm = self.bm
        free, evictable = list(bm.free_ids), list(bm.evictable)
        referenced = [b.block_id for b in bm.blocks if b.ref_count > 0]
        assert len(set(free)) == len(free), "a block is free twice"
        assert sorted(free + evictable + referenced) == list(range(bm.num_blocks))
        assert all(bm.blocks[i].ref_count == 0 and bm.blocks[i].hash is None for i in free)
        assert all(bm.blocks[i].ref_count == 0 and bm.blocks[i].hash is not None for i in evictable)
        assert bm.num_free_blocks == len(free) + len(evictable)
        assert bm.num_used_blocks == len(referenced)
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        assert bm.pending_copies == []  # every allocation here is followed by its forward

    @invariant()
    def ref_counts_match_block_tables(self) -> None:
        uses = Counter(b for s in self.live for b in s.block_table)
        assert all(s.block_table == [] for s in self.waiting)
        assert {b.block_id: b.ref_count for b in self.bm.blocks if b.ref_count} == dict(uses)
        for s in self.live:
            assert len(set(s.block_table)) == len(s.block_table)

    @invariant()
    def cache_index_matches_block_hashes(self) -> None:
        hashed = {b.hash: b.block_id for b in self.bm.blocks if b.hash is not None}
        assert len(hashed) == sum(b.hash is not None for b in self.bm.blocks)  # no hash on two blocks
        assert hashed == self.bm.cached
        if not self.bm.enable_prefix_caching:
            assert self.bm.cached == {}

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self) -> None:
        for h, block_id in self.bm.cached.items():
            tokens = self.hash_history[h]
            start = len(tokens) - BS
            assert self.kv[block_id] == [tokens[: p + 1] for p in range(start, len(tokens))]

    @invariant()
    def sequences_keep_their_own_hashes(self) -> None:
        for s in self.live + self.waiting:
            assert s.block_hashes == chain_hashes(s.token_ids, len(s.block_hashes))
        for s in self.live:
            hashes = chain_hashes(s.token_ids, s.num_computed_tokens // BS)
            assert all(self.bm.blocks[b].hash in (None, h) for b, h in zip(s.block_table, hashes))

    @invariant()
    def live_sequences_read_back_their_tokens(self) -> None:
        for s in self.live:
            assert 0 < s.num_computed_tokens <= s.num_tokens
            assert len(s.block_table) == self.bm.blocks_for(s.num_computed_tokens)
            for pos in range(s.num_computed_tokens):
                assert self.kv[s.block_table[pos // BS]][pos % BS] == tuple(s.token_ids[: pos + 1]), (
                    f"seq {s.seq_id} reads wrong KV at position {pos}"
                )


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
