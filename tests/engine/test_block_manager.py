"""BlockManager: ref counts, the prefix cache, LRU eviction, fork with copy-on-write; and a stateful
model where the real Scheduler drives it, the KV writes are simulated, and every running sequence
reads its own history back through its block table."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.block_manager import BlockManager, block_hash
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from engine.sequence import Request, Sequence, SequenceStatus
from engine.speculative import Lookahead, Proposer
from tests.engine.test_scheduler import Engine

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
# Stateful model: the real scheduler drives the block manager


class CheckedBlockManager(BlockManager):
    """The real BlockManager, each call checked against what it promises: hits are the longest run of
    cached leading blocks, an allocation takes fresh blocks from the free list first and then the
    least recently freed cached ones, a refused one fits nowhere and changes nothing, and a free
    puts blocks at the back of their queue, tail first."""

    def match_prefix(self, seq: Sequence) -> list[int]:
        hits = super().match_prefix(seq)
        expected = []
        for h in chain_hashes(seq.token_ids, (seq.num_tokens - 1) // BS) if self.enable_prefix_caching else []:
            if h not in self.cached:
                break
            expected.append(self.cached[h])
        assert hits == expected
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        before = snapshot(self, seq)
        table, hits = list(seq.block_table), list(cached_blocks)
        num_computed = seq.num_computed_tokens + len(hits) * BS
        revived = [b for b in hits if self.blocks[b].ref_count == 0]
        shared_partial = bool(table and num_computed % BS and self.blocks[table[-1]].ref_count > 1)
        need = max(self.blocks_for(num_computed + num_new_tokens) - len(table) - len(hits), 0) + shared_partial
        free_before = list(self.free_ids)
        evictable_left = [b for b in self.evictable if b not in revived]
        if not super().allocate_slots(seq, num_new_tokens, cached_blocks):
            assert snapshot(self, seq) == before
            assert need > self.num_free_blocks - len(revived)  # refused only when it really does not fit
            return False
        taken = seq.block_table[len(table) + len(hits):]
        if shared_partial:
            taken.insert(0, seq.block_table[len(table) - 1])
            assert seq.block_table[: len(table) - 1] == table[:-1]
        else:
            assert seq.block_table[: len(table)] == table
        assert seq.block_table[len(table): len(table) + len(hits)] == hits
        assert taken == (free_before + evictable_left)[:need]
        assert list(self.evictable) == evictable_left[max(need - len(free_before), 0):]
        assert len(seq.block_table) == self.blocks_for(num_computed + num_new_tokens)
        queries, hit_tokens = before[5], before[6]
        if self.enable_prefix_caching and not table:  # an admission is one lookup
            queries, hit_tokens = queries + seq.num_tokens, hit_tokens + len(hits) * BS
        assert (self.prefix_queries, self.prefix_hits) == (queries, hit_tokens)
        return True

    def free(self, seq: Sequence) -> None:
        table = list(seq.block_table)
        free_before, evictable_before = list(self.free_ids), list(self.evictable)
        super().free(seq)
        assert seq.block_table == []
        released = [b for b in reversed(table) if self.blocks[b].ref_count == 0]
        assert list(self.free_ids) == free_before + [b for b in released if self.blocks[b].hash is None]
        assert list(self.evictable) == evictable_before + [b for b in released if self.blocks[b].hash is not None]


class SimulatedKV(Engine):
    """An Engine whose forward writes each token's simulated KV into its slot, copies first."""

    def __init__(self, num_blocks: int, *args, **kwargs) -> None:
        super().__init__(num_blocks, *args, block_manager_type=CheckedBlockManager, **kwargs)
        self.kv: dict[int, list[Slot | None]] = {i: [None] * BS for i in range(num_blocks)}

    def forward(self, out: SchedulerOutput, writes: list[tuple[ScheduledSequence, int, int]]) -> None:
        blocks = self.block_manager.blocks
        for src, dst in out.block_copies:
            assert blocks[dst].hash is None and blocks[dst].ref_count <= 1
            self.kv[dst] = list(self.kv[src])
        for s, pos, block_id in writes:
            seq = s.seq
            history = tuple(seq.token_ids[: pos + 1])  # a step's drafts stand in its tokens until read
            # Writing into a block that the cache serves, or that a sequence with other tokens reads,
            # corrupts it. Samples forked in this step share the block with the same tokens; a
            # sequence that finished while its last step was in flight writes into a block now free,
            # and so may stale rows (launched on drafts that were then rejected), until the next step.
            assert blocks[block_id].hash is None, f"write into cached block {block_id}"
            readers = [r for r in self.scheduler.running if block_id in r.block_table]
            assert all(tuple(r.token_ids[: pos + 1]) == history for r in readers if r is not seq), (
                f"write into shared block {block_id}")
            assert seq in readers or ((seq.is_finished or s.stale) and not readers)
            self.kv[block_id][pos % BS] = history


class GuessingProposer(Proposer):
    """Drafts the simulated model's own next tokens (Engine.sample), each wrong where its seed and
    position say so: some steps accept every draft, others reject from any point, and some
    positions have nothing to propose. It drafts past tokens in flight too (guesses)."""

    guesses = True

    def __init__(self, engine: Engine, num_tokens: int) -> None:
        self.engine, self.num_tokens = engine, num_tokens

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        start = seq.num_tokens
        if (seq.seed + start) % 5 == 0:
            return []
        return [(self.engine.sample(seq, p) + ((seq.seed + p) % 3 == 0)) % self.engine.vocab
                for p in range(start, start + min(self.num_tokens, limit))]


PROMPT_BASES = ([0, 1, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0], [2] * 12)
prompts = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(PROMPT_BASES),
    st.integers(1, 12),
    st.lists(st.integers(0, 2), max_size=6),
)
MAX_TOKENS = 8  # with prompts of up to 18 tokens, a request fits 7 blocks: the smallest pool


class SchedulerMachine(RuleBasedStateMachine):
    """The real Scheduler over the real BlockManager, stepped the way LLMEngine steps them (with and
    without overlap), with forks, early stops and aborts; three tokens in the vocabulary, so prompts
    and outputs share prefixes. After every step: the scheduler kept its policy (budgets, the
    newest preempted, first come first served), every block is accounted for, the cache index
    matches the blocks, and every running sequence reads its own history back through its block table."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: SimulatedKV
        self.hash_history: dict[bytes, tuple[int, ...]] = {}  # a chained hash -> the tokens it covers
        self.forked: set[Sequence] = set()  # running sequences that were forked in, not admitted

    @initialize(num_blocks=st.integers(7, 10), max_num_seqs=st.integers(1, 6),
                max_num_batched_tokens=st.integers(1, 24), prefix_caching=st.sampled_from([True, True, False]),
                overlap=st.booleans(), drafts=st.sampled_from([0, 0, 1, 3]),
                min_progress=st.sampled_from([None, 0.0, 0.8]))
    def setup(self, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool,
              overlap: bool, drafts: int, min_progress: float | None) -> None:
        self.engine = SimulatedKV(num_blocks, max_num_seqs, max_num_batched_tokens, prefix_caching=prefix_caching,
                                  overlap=overlap, vocab=3)
        if drafts:  # speculation: decodes carry drafts, and the rejected ones' KV slots are rolled back
            self.engine.scheduler.proposer = GuessingProposer(self.engine, drafts)
            if min_progress is not None:  # steps go ahead of those with drafts (all of them at 0)
                self.engine.scheduler.lookahead = Lookahead()
                self.engine.scheduler.lookahead.min_progress = min_progress
                self.engine.scheduler.lookahead.gate = None

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    @property
    def bm(self) -> BlockManager:
        return self.engine.block_manager

    # -- rules ----------------------------------------------------------------------------------

    @rule(prompt=prompts, max_tokens=st.integers(1, MAX_TOKENS), n=st.integers(1, 3), seed=st.integers(0, 2),
          stops=st.booleans())
    def add(self, prompt: list[int], max_tokens: int, n: int, seed: int, stops: bool) -> None:
        n = min(n, self.scheduler.max_num_seqs)  # the engine refuses more samples than run at once (a 400)
        self.engine.add(prompt, max_tokens, n, seed, eos=[2] if stops else [])

    @rule()
    def step(self) -> None:
        self._step()

    @precondition(lambda self: self.engine.requests)
    @rule(i=st.integers(0, 99))
    def abort(self, i: int) -> None:
        requests = list(self.engine.requests.values())
        self.engine.abort(requests[i % len(requests)])
        self.forked = {s for s in self.forked if s.status == SequenceStatus.RUNNING}

    @rule()
    def drain(self) -> None:
        """Step until every request is done: nothing starves, and every block comes back."""
        for _ in range(500):
            if not self.engine.requests and self.engine.in_flight is None:
                break
            self._step()
            self.check()
        assert not self.engine.requests, "no progress in 500 steps"
        assert self.bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in self.bm.blocks)
        assert not self.scheduler.running and not self.scheduler.waiting

    def _step(self) -> None:
        """One engine step, its schedule checked against the policy."""
        scheduler = self.scheduler
        landing = [s.seq for s, _ in self.engine.in_flight or ()]  # their drafts' blocks may fill now
        self.engine.settle()
        self._remember(landing)
        running, waiting = list(scheduler.running), list(scheduler.waiting)
        remaining = {s: s.num_tokens - s.num_computed_tokens for s in running}
        decodes = [s for s in running if remaining[s] == 1]
        preemptions = scheduler.num_preemptions
        out = scheduler.schedule()

        budget = scheduler.max_num_batched_tokens
        assert out.num_batched_tokens <= budget
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
        forks = [s.seq for s in out.scheduled if s.sample_from is not None]
        for s in out.scheduled:
            if s.num_new_tokens:
                assert s.seq.status == SequenceStatus.RUNNING
                num_new = s.num_new_tokens - len(s.drafts)  # drafts ride on a decode's one token
                assert num_new == 1 or not s.drafts
                assert s.seq.num_computed_tokens + num_new <= s.seq.num_tokens
                assert s.samples == (s.seq.num_computed_tokens + num_new == s.seq.num_tokens)
                assert s.seq in running or s.seq in waiting
            else:
                assert s.seq in forks and s.samples and s.sample_from.request is s.seq.request
        # Preemption takes the newest: no older sequence gave way while a newer one kept running.
        victims = [s for s in running + forks if s.status == SequenceStatus.WAITING]
        kept = [s.status == SequenceStatus.RUNNING for s in running]
        assert kept == sorted(kept, reverse=True)
        assert scheduler.num_preemptions - preemptions == len(victims)
        if victims:  # they wait at the front, oldest first, and nothing else is admitted
            assert list(scheduler.waiting) == victims + waiting
        else:  # admitted first come first served, but a prompt longer than the step may be passed...
            admitted = [s for s in waiting if s.status == SequenceStatus.RUNNING]
            assert list(scheduler.waiting) == [s for s in waiting if s not in admitted]
            passed = [s for s in waiting[: waiting.index(admitted[-1])] if s not in admitted] if admitted else []
            chunking = any(s.num_new_tokens and s.seq.num_computed_tokens + s.num_new_tokens < s.seq.num_tokens
                           for s in out.scheduled)
            assert not passed or chunking  # ...only while another prompt is prefilled in chunks
        # Decodes are served before prefill chunks: all of them, while the budget holds them.
        if len(decodes) <= budget:
            scheduled = {s.seq: s.num_new_tokens for s in out.scheduled}
            drafts = {s.seq: len(s.drafts) for s in out.scheduled}
            assert all(scheduled.get(s) == 1 + drafts.get(s, 0) for s in decodes if s.status == SequenceStatus.RUNNING)

        computed = {s.seq: s.seq.num_computed_tokens for s in out.scheduled}
        landing = [s.seq for s, _ in self.engine.in_flight or ()]
        self.engine.run(out)
        self.forked = {s for s in self.forked | set(forks) if s.status == SequenceStatus.RUNNING}
        self._remember([*computed, *landing])
        for seq, old in computed.items():  # drafts in flight are hashed once read
            hashes = chain_hashes(seq.token_ids, min(seq.num_computed_tokens, seq.num_real_tokens) // BS)
            if self.bm.enable_prefix_caching and not seq.is_finished:  # every block the step filled is findable
                assert all(h in self.bm.cached for h in hashes[old // BS:])

    def _remember(self, seqs: list[Sequence]) -> None:
        """The tokens each computed full block of real tokens' chained hash covers, for check_cache."""
        for seq in seqs:
            for i, h in enumerate(chain_hashes(seq.token_ids, min(seq.num_computed_tokens, seq.num_real_tokens) // BS)):
                self.hash_history.setdefault(h, tuple(seq.token_ids[: (i + 1) * BS]))

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def holds(self) -> None:
        self.check()

    def check(self) -> None:
        self.check_queues()
        self.check_blocks()
        self.check_cache()
        self.check_kv()

    def check_queues(self) -> None:
        scheduler = self.scheduler
        live = [s for r in self.engine.requests.values() for s in r.sequences if not s.is_finished]
        assert {s.seq_id for s in live} == {s.seq_id for s in [*scheduler.running, *scheduler.waiting]}
        assert all(s.status == SequenceStatus.RUNNING for s in scheduler.running)
        assert all(s.status == SequenceStatus.WAITING and s.block_table == [] for s in scheduler.waiting)
        # Forks come in with their parent; everything else is admitted only below max_num_seqs.
        assert len([s for s in scheduler.running if s not in self.forked]) <= scheduler.max_num_seqs

    def check_blocks(self) -> None:
        bm = self.bm
        free, evictable = list(bm.free_ids), list(bm.evictable)
        referenced = [b.block_id for b in bm.blocks if b.ref_count > 0]
        assert len(set(free)) == len(free), "a block is free twice"
        assert sorted(free + evictable + referenced) == list(range(bm.num_blocks))
        assert all(bm.blocks[i].ref_count == 0 and bm.blocks[i].hash is None for i in free)
        assert all(bm.blocks[i].ref_count == 0 and bm.blocks[i].hash is not None for i in evictable)
        assert bm.num_free_blocks == len(free) + len(evictable)
        assert bm.num_used_blocks == len(referenced)
        assert bm.pending_copies == []  # each step's copies went out with it
        uses = Counter(b for s in self.scheduler.running for b in s.block_table)
        assert {b.block_id: b.ref_count for b in bm.blocks if b.ref_count} == dict(uses)
        # Drafts in flight are counted computed, and rejected ones taken back when they are read.
        for s in self.scheduler.running:
            assert len(set(s.block_table)) == len(s.block_table)
            assert len(s.block_table) == bm.blocks_for(s.num_computed_tokens)

    def check_cache(self) -> None:
        hashed = {b.hash: b.block_id for b in self.bm.blocks if b.hash is not None}
        assert len(hashed) == sum(b.hash is not None for b in self.bm.blocks)  # no hash on two blocks
        assert hashed == self.bm.cached
        if not self.bm.enable_prefix_caching:
            assert self.bm.cached == {}
        for h, block_id in self.bm.cached.items():  # a hit serves the KV of equal tokens
            tokens = self.hash_history[h]
            start = len(tokens) - BS
            assert self.engine.kv[block_id] == [tokens[: p + 1] for p in range(start, len(tokens))]
        for s in [*self.scheduler.running, *self.scheduler.waiting]:
            assert s.block_hashes == chain_hashes(s.token_ids, len(s.block_hashes))

    def check_kv(self) -> None:
        for s in self.scheduler.running:
            assert 0 < s.num_computed_tokens <= s.num_tokens
            assert all(t >= 0 for t in s.token_ids[: s.num_computed_tokens])
            for pos in range(s.num_computed_tokens):
                assert self.engine.kv[s.block_table[pos // BS]][pos % BS] == tuple(s.token_ids[: pos + 1]), (
                    f"seq {s.seq_id} reads wrong KV at position {pos}"
                )


TestSchedulerStateful = SchedulerMachine.TestCase
TestSchedulerStateful.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def salted_seq(token_ids: list[int], cache_salt: str | None) -> Sequence:
    request = Request("r", list(token_ids), SamplingParams(cache_salt=cache_salt), max_tokens=16,
                      eos_token_ids=frozenset())
    return Sequence(request, 0, list(token_ids), seed=0)


def test_the_same_prompt_under_two_salts_shares_no_block() -> None:
    bm = BlockManager(32, BS)
    prompt = list(range(13))  # 3 full blocks before the last token
    seqs = {salt: salted_seq(prompt, salt) for salt in (None, "tenant-a", "tenant-b")}
    for seq in seqs.values():
        assert admit(bm, seq) == []  # each salt misses what the others cached
    blocks = [set(seq.block_table) for seq in seqs.values()]
    assert blocks[0].isdisjoint(blocks[1]) and blocks[0].isdisjoint(blocks[2]) and blocks[1].isdisjoint(blocks[2])
    hashes = [set(seq.block_hashes) for seq in seqs.values()]
    assert all(len(h) == 3 for h in hashes) and len(hashes[0] | hashes[1] | hashes[2]) == 9
    assert seqs[None].block_hashes == chain_hashes(prompt, 3)  # unsalted chains are as before
    # The same salt still shares: its whole cached prefix is a hit.
    again = salted_seq(prompt, "tenant-a")
    assert admit(bm, again) == seqs["tenant-a"].block_table[:3]
