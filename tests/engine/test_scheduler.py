"""Scheduler: token and sequence budgets, chunked prefill, prefix-cache hits, preemption of the
newest sequence by recompute, and first-come first-served admission, on a real BlockManager with
no model. `Engine` stands in for LLMEngine's side of each step."""
from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput, derive_seed
from engine.sequence import Request, Sequence, SequenceStatus, placeholder
from engine.speculative import Proposer, accepted

BS = 4  # block size everywhere in this file


class Engine:
    """LLMEngine.step's calls into the scheduler (engine/llm_engine.py: step, _launch, _read,
    _ends, abort) with the model left out: a sampled token is a function of the sample's seed and
    position, so a sequence recomputed after preemption samples the same tokens again.

    With overlap (the engine's default), a step's tokens are read in the next step, after that step
    was scheduled: a sequence that finished is decoded once more, and its surplus token dropped.
    Without it, tokens land before the next step is scheduled, as for penalized requests. Under
    speculation (a `proposer`) they do whenever a step in flight carries drafts or the next may,
    and each draft's position is sampled and checked (_accept); with the scheduler's lookahead, a
    step may go ahead of one with drafts, and a rejection makes its rows stale."""

    def __init__(self, num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 64, *,
                 prefix_caching: bool = True, overlap: bool = False, vocab: int = 1000,
                 block_manager_type: type[BlockManager] = BlockManager, proposer: Proposer | None = None) -> None:
        self.block_manager = block_manager_type(num_blocks, BS, prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, proposer)
        self.overlap = overlap
        self.vocab = vocab
        self.requests: dict[str, Request] = {}
        self.finished: list[str] = []  # request ids, in the order they finished
        self._ids = itertools.count()
        # Sampling sequences, and their placeholders' positions (or where their drafts start).
        self.in_flight: list[tuple[ScheduledSequence, int]] | None = None

    def add(self, prompt: Iterable[int], max_tokens: int = 1, n: int = 1, seed: int = 0,
            request_id: str | None = None, eos: Iterable[int] = ()) -> Request:
        request_id = request_id or f"r{next(self._ids)}"
        request = Request(request_id, list(prompt), SamplingParams(n=n, seed=seed), max_tokens, frozenset(eos))
        seq = Sequence(request, 0, list(request.prompt_token_ids), seed)
        request.sequences.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request

    def abort(self, request: Request) -> None:
        del self.requests[request.request_id]
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def step(self) -> SchedulerOutput:
        self.settle()
        out = self.scheduler.schedule()
        self.run(out)
        return out

    def settle(self) -> None:
        """What LLMEngine.step does before it schedules: under speculation, land the step in flight."""
        in_flight = [s for s, _ in self.in_flight or ()]
        if self.in_flight is not None and (self.scheduler.drafting() or (
                any(s.drafts for s in in_flight) and not self.scheduler.goes_ahead(in_flight))):
            self._collect(self.in_flight)  # drafts follow real ids, and move a sequence by what is accepted
            self.in_flight = None

    def run(self, out: SchedulerOutput) -> None:
        """Everything LLMEngine.step does after schedule(), in its order."""
        # What the runner writes, named when the step is launched (block tables may be freed before it
        # lands): (the scheduled sequence, position, block).
        writes = [(s, pos, s.seq.block_table[pos // BS]) for s in out.scheduled
                  for pos in range(s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new_tokens)]
        launched = []
        row = 0
        for s in out.scheduled:
            if s.samples:
                launched.append((s, s.seq.num_tokens))
                s.seq.token_ids += s.drafts
                s.seq.token_ids.append(placeholder(row + len(s.drafts)))
                s.seq.num_placeholders += 1 + len(s.drafts)
                row += 1 + len(s.drafts)
        if self.in_flight is not None:
            self._collect(self.in_flight, launched)
            self.in_flight = None
        self.forward(out, writes)
        self.scheduler.update_computed(out)
        if self.overlap:
            self.in_flight = launched or None
        else:
            self._collect(launched)

    def forward(self, out: SchedulerOutput, writes: list[tuple[ScheduledSequence, int, int]]) -> None:
        """The step's KV writes, (scheduled sequence, position, block), after out.block_copies; its
        inputs are all real ids by now, but for stale rows. Nothing to do without a model."""

    def sample(self, seq: Sequence, position: int) -> int:
        return (seq.seed + 7 * position) % self.vocab

    def _collect(self, launched: list[tuple[ScheduledSequence, int]],
                 after: list[tuple[ScheduledSequence, int]] | None = None) -> None:
        """Read a step (`after`: the one launched behind it)."""
        for s, position in launched:
            seq = s.seq
            if seq.is_finished or s.stale:  # aborted, done or rolled back in the step before: surplus
                continue
            if s.drafts:
                self._accept(s, position, after)
            else:
                seq.token_ids[position] = self.sample(seq, position)
                seq.num_placeholders -= 1
                self._append(seq, position)

    def _accept(self, s: ScheduledSequence, start: int, after: list[tuple[ScheduledSequence, int]] | None) -> None:
        seq, k = s.seq, len(s.drafts)
        sampled = [self.sample(seq, start + i) for i in range(k + 1)]
        confirmed = accepted(s.drafts, sampled)
        seq.drafting.record(k, confirmed, self.scheduler.proposer.num_tokens)
        if confirmed == k:
            seq.token_ids[start + k] = sampled[k]
            seq.num_placeholders -= k + 1
        else:
            del seq.token_ids[start + confirmed:]
            seq.token_ids.append(sampled[confirmed])
            seq.num_placeholders = 0
            seq.num_computed_tokens = min(seq.num_computed_tokens, start + confirmed)
            self.block_manager.trim(seq)
            for t, _ in after or ():
                t.stale = t.stale or t.seq is seq
        for i in range(confirmed + 1):
            self._append(seq, start + i)
            if seq.is_finished:
                del seq.token_ids[start + i + 1:]
                return
        self.block_manager.cache_full_blocks(seq, start - 1)

    def _append(self, seq: Sequence, position: int) -> None:
        request, token_id = seq.request, seq.token_ids[position]
        if token_id in request.eos_token_ids:
            self.scheduler.finish(seq, "stop")
        elif position + 1 - request.num_prompt_tokens >= request.max_tokens:
            self.scheduler.finish(seq, "length")
        if request.is_finished and request.request_id in self.requests:
            del self.requests[request.request_id]
            self.finished.append(request.request_id)

    def run_all(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        """Step until every request has finished; the steps' outputs."""
        outs = []
        while self.requests or self.in_flight:
            assert len(outs) < max_steps, "no progress"
            outs.append(self.step())
        return outs


def name(seq: Sequence) -> str:
    return seq.request.request_id + (f".{seq.index}" if seq.index else "")


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    """A step as (sequence, tokens it computes)."""
    return [(name(s.seq), s.num_new_tokens) for s in out.scheduled]


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# ---------------------------------------------------------------------------------------------------
# Budgets


def test_token_and_sequence_budgets_make_an_exact_schedule() -> None:
    engine = Engine(max_num_seqs=2, max_num_batched_tokens=8)
    for i in range(5):
        engine.add(tokens(10, 100 * i), max_tokens=2)
    outs = engine.run_all()
    assert [plan(out) for out in outs] == [
        [("r0", 8)],  # a chunk: the prompt does not fit the budget
        [("r0", 2), ("r1", 6)],  # r0's last chunk, then r1 takes what is left
        [("r0", 1), ("r1", 4)],  # r0 decodes; max_num_seqs keeps r2 out though 3 tokens are left
        [("r1", 1), ("r2", 7)],
        [("r2", 3), ("r3", 5)],
        [("r2", 1), ("r3", 5)],
        [("r3", 1), ("r4", 7)],
        [("r4", 3)],
        [("r4", 1)],
    ]
    assert engine.finished == ["r0", "r1", "r2", "r3", "r4"]
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("max_num_seqs", "max_num_batched_tokens"), [(1, 5), (3, 7), (4, 64), (16, 3)])
def test_budgets_are_never_exceeded(max_num_seqs: int, max_num_batched_tokens: int, overlap: bool) -> None:
    engine = Engine(num_blocks=6, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    overlap=overlap)
    for i in range(12):  # up to 24 tokens: one request may need the whole pool of 6 blocks
        engine.add(tokens(1 + 5 * i % 17, 10 * i), max_tokens=1 + i % 7)
    for out in engine.run_all():
        assert out.num_batched_tokens <= max_num_batched_tokens
        assert len(out.scheduled) <= max_num_seqs and len(engine.scheduler.running) <= max_num_seqs
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
    assert len(engine.finished) == 12 and engine.block_manager.num_used_blocks == 0
    assert engine.scheduler.num_preemptions > 0 or max_num_seqs == 1


def test_decodes_are_scheduled_before_a_prefill_chunk() -> None:
    engine = Engine(max_num_batched_tokens=8)
    engine.add(tokens(3), max_tokens=8, request_id="a")
    engine.add(tokens(2, 10), max_tokens=8, request_id="b")
    engine.add(tokens(2, 20), max_tokens=8, request_id="c")
    assert plan(engine.step()) == [("a", 3), ("b", 2), ("c", 2)]
    engine.add(tokens(20, 30), max_tokens=8, request_id="d")
    assert plan(engine.step()) == [("a", 1), ("b", 1), ("c", 1), ("d", 5)]
    assert plan(engine.step()) == [("a", 1), ("b", 1), ("c", 1), ("d", 5)]  # d's next chunk too: what decodes leave


def test_a_budget_smaller_than_the_decodes_serves_the_oldest_first() -> None:
    engine = Engine(max_num_batched_tokens=2)
    engine.add(tokens(1), max_tokens=2, n=3)  # forks can outnumber the budget
    assert plan(engine.step()) == [("r0", 1), ("r0.1", 0), ("r0.2", 0)]
    assert plan(engine.step()) == [("r0", 1), ("r0.1", 1)]
    assert plan(engine.step()) == [("r0.2", 1)]


# ---------------------------------------------------------------------------------------------------
# Chunked prefill and the prefix cache


def test_long_prompt_is_prefilled_in_chunks_that_resume_where_they_stopped() -> None:
    engine = Engine(max_num_batched_tokens=8)
    request = engine.add(tokens(30), max_tokens=2)
    seq = request.sequences[0]
    computed, samples = [], []
    while engine.requests:
        computed.append(seq.num_computed_tokens)
        out = engine.step()
        [s] = out.scheduled
        samples.append(s.samples)
        assert s.num_new_tokens <= 8
    assert computed == [0, 8, 16, 24, 30]  # each chunk starts at the end of the one before
    assert samples == [False, False, False, True, True]  # only a chunk that reaches the end samples
    assert engine.scheduler.num_computed_prompt_tokens == 30


def test_prefix_cache_hit_skips_the_cached_tokens() -> None:
    engine = Engine(max_num_batched_tokens=8)
    prefix = tokens(12, 500)  # three full blocks
    engine.add(prefix + [1], max_tokens=1, request_id="a")
    engine.run_all()
    assert engine.scheduler.num_computed_prompt_tokens == 13

    b = engine.add(prefix + tokens(10, 900), max_tokens=1, request_id="b")
    out = engine.step()
    assert plan(out) == [("b", 8)] and out.scheduled[0].seq.num_computed_tokens == 12 + 8
    assert plan(engine.step()) == [("b", 2)]  # the chunk resumes after the hit and the first chunk
    assert b.sequences[0].num_cached_prompt_tokens == 12
    assert engine.scheduler.num_computed_prompt_tokens == 13 + 10
    # The whole prompt cached: its last block is still computed, for the logits of its last token.
    c = engine.add(prefix, max_tokens=1, request_id="c")
    assert plan(engine.step()) == [("c", 4)]
    assert c.sequences[0].num_cached_prompt_tokens == 8


def test_a_hit_needs_the_whole_prefix_equal() -> None:
    engine = Engine()
    engine.add(tokens(12, 500) + [1], max_tokens=1)
    engine.run_all()
    changed = tokens(12, 500)
    changed[5] = 0  # the second block differs: only the first block can hit
    engine.add(changed + [1], max_tokens=1, request_id="b")
    assert plan(engine.step()) == [("b", 9)]
    engine.add([0] + tokens(12, 501), max_tokens=1, request_id="c")  # shifted by one: no block hits
    assert plan(engine.step()) == [("c", 13)]
    off = Engine(prefix_caching=False)
    off.add(tokens(12, 500) + [1], max_tokens=1)
    off.run_all()
    off.add(tokens(12, 500) + [1], max_tokens=1, request_id="b")
    assert plan(off.step()) == [("b", 13)]


# ---------------------------------------------------------------------------------------------------
# Preemption


def test_newest_running_sequence_is_preempted_by_recompute() -> None:
    engine = Engine(num_blocks=4, max_num_batched_tokens=16)
    a, b, c = (engine.add(tokens(3, 10 * i), max_tokens=6, request_id=x) for i, x in enumerate("abc"))
    assert plan(engine.step()) == [("a", 3), ("b", 3), ("c", 3)]  # a block each, one left
    engine.add(tokens(5, 90), max_tokens=2, request_id="d")  # needs two blocks
    assert plan(engine.step()) == [("a", 1), ("b", 1), ("c", 1)]  # each fills its block; d cannot start
    c_tokens = list(c.sequences[0].token_ids)
    # a takes the last free block; b finds none, so c, the newest, gives its own back.
    assert plan(engine.step()) == [("a", 1), ("b", 1)]
    seq = c.sequences[0]
    assert engine.scheduler.num_preemptions == 1
    assert (seq.status, seq.num_computed_tokens, seq.block_table) == (SequenceStatus.WAITING, 0, [])
    assert seq.token_ids == c_tokens  # what it sampled is kept: the recompute continues from it
    assert [name(s) for s in engine.scheduler.waiting] == ["c", "d"]  # at the front, ahead of d
    assert [name(s) for s in engine.scheduler.running] == ["a", "b"]
    assert engine.block_manager.num_free_blocks == 0

    outs = engine.run_all()
    resumed = next(plan(out) for out in outs if any(s.seq is seq for s in out.scheduled))
    assert resumed == [("c", 5), ("d", 5)]  # once a and b are done: c first, all its tokens recomputed
    assert seq.output_token_ids == [engine.sample(seq, p) for p in range(3, 9)]  # as if never preempted
    assert engine.finished == ["a", "b", "d", "c"] and engine.block_manager.num_used_blocks == 0


def test_a_sequence_that_is_the_newest_preempts_itself() -> None:
    engine = Engine(num_blocks=3, max_num_batched_tokens=16)
    engine.add(tokens(4), max_tokens=4, request_id="a")
    engine.add(tokens(4, 10), max_tokens=4, request_id="b")
    assert plan(engine.step()) == [("a", 4), ("b", 4)]
    # Both need a second block, one is free: a takes it, b is the newest and gives way.
    assert plan(engine.step()) == [("a", 1)]
    assert [name(s) for s in engine.scheduler.waiting] == ["b"] and engine.scheduler.num_preemptions == 1


def test_a_step_that_preempts_admits_nothing() -> None:
    engine = Engine(num_blocks=4, max_num_batched_tokens=8)
    engine.add(tokens(2), max_tokens=5, request_id="a")
    p = engine.add(tokens(14, 10), max_tokens=1, request_id="p")
    assert plan(engine.step()) == [("a", 2), ("p", 6)]
    # p's next chunk (7 tokens, to 13) needs two more blocks, one is free: p is the newest and gives way.
    # From its cached first block a chunk of 7 would fit now, but memory was just short: it waits a step.
    assert plan(engine.step()) == [("a", 1)]
    assert [name(s) for s in engine.scheduler.waiting] == ["p"] and engine.scheduler.num_preemptions == 1
    assert plan(engine.step()) == [("a", 1), ("p", 7)]
    assert p.sequences[0].num_cached_prompt_tokens == 4


def test_preemption_frees_as_many_newest_as_it_takes() -> None:
    engine = Engine(num_blocks=2, max_num_batched_tokens=16)
    engine.add(tokens(4), max_tokens=2, request_id="a")  # one full block: its first decode needs another
    b = engine.add(tokens(3, 10), max_tokens=3, n=2, request_id="b")
    assert plan(engine.step()) == [("a", 4), ("b", 3), ("b.1", 0)]  # b.1 forks off b's prompt block
    # b.1 shares its only block with b: preempting it frees nothing, so b goes too, b first in the queue.
    assert plan(engine.step()) == [("a", 1)]
    assert [name(s) for s in engine.scheduler.waiting] == ["b", "b.1"] and engine.scheduler.num_preemptions == 2
    engine.run_all()
    assert engine.finished == ["a", "b"] and engine.block_manager.num_used_blocks == 0
    roomy = Engine(num_blocks=64)
    roomy.add(tokens(4), max_tokens=2, request_id="a")
    alone = roomy.add(tokens(3, 10), max_tokens=3, n=2, request_id="b")
    roomy.run_all()
    assert [s.output_token_ids for s in b.sequences] == [s.output_token_ids for s in alone.sequences]


# ---------------------------------------------------------------------------------------------------
# Fairness


def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    engine = Engine(num_blocks=4, max_num_batched_tokens=32)
    engine.add(tokens(7), max_tokens=3, request_id="a")  # two blocks
    assert plan(engine.step()) == [("a", 7)]
    engine.add(tokens(12, 10), max_tokens=1, request_id="b")  # three blocks: not while a holds two
    engine.add(tokens(2, 30), max_tokens=1, request_id="c")  # one block would fit, but b came first
    assert plan(engine.step()) == [("a", 1)]
    assert [name(s) for s in engine.scheduler.waiting] == ["b", "c"]
    assert plan(engine.step()) == [("a", 1)]
    assert plan(engine.step()) == [("b", 12), ("c", 2)]  # a is done: room for both, in order


def test_no_request_starves_under_a_steady_stream() -> None:
    engine = Engine(num_blocks=10, max_num_seqs=4, max_num_batched_tokens=16)
    engine.add(tokens(24), max_tokens=12, request_id="long")
    arrival, first_step, done_step = {"long": 0}, {}, {}
    for step in range(400):
        if step % 3 == 0 and step < 200:  # a new request every third step, about what the pool serves
            request = engine.add(tokens(3 + step % 7, step), max_tokens=6 + step % 8)
            arrival[request.request_id] = step
        out = engine.step()
        for s in out.scheduled:
            first_step.setdefault(s.seq.request.request_id, step)
        for request_id in engine.finished:
            done_step.setdefault(request_id, step)
        if not engine.requests and step >= 200:
            break
    assert not engine.requests and done_step.keys() == arrival.keys()
    assert engine.scheduler.num_preemptions > 20  # memory was short often
    assert sorted(first_step, key=first_step.get) == list(arrival)  # started in arrival order
    assert done_step["long"] < 20  # the oldest is never the one preempted
    assert max(done_step[r] - arrival[r] for r in arrival) < 40


# ---------------------------------------------------------------------------------------------------
# The engine's side: overlap, aborts, forks


def test_overlap_decodes_a_finished_sequence_once_more_then_frees_it() -> None:
    engine = Engine(overlap=True)
    request = engine.add(tokens(5), max_tokens=3)
    seq = request.sequences[0]
    assert [plan(out) for out in engine.run_all()] == [[("r0", 5)], [("r0", 1)], [("r0", 1)], [("r0", 1)], []]
    assert seq.output_token_ids == [engine.sample(seq, p) for p in range(5, 8)]  # the surplus fourth is dropped
    assert (seq.finish_reason, seq.num_placeholders) == ("length", 0)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_returns_blocks_and_drops_tokens_in_flight(overlap: bool) -> None:
    engine = Engine(overlap=overlap)
    keep = engine.add(tokens(6), max_tokens=4)
    gone = engine.add(tokens(9, 10), max_tokens=8, n=2)
    waiting = engine.add(tokens(5, 30), max_tokens=8)
    engine.step()
    engine.step()
    used = engine.block_manager.num_used_blocks
    engine.abort(gone)
    assert all(s.finish_reason == "abort" and s.block_table == [] for s in gone.sequences)
    assert engine.block_manager.num_used_blocks < used
    assert all(s.num_real_tokens == s.num_tokens for s in gone.sequences)  # no placeholder left behind
    engine.abort(waiting)
    engine.run_all()
    assert keep.sequences[0].finish_reason == "length" and engine.block_manager.num_used_blocks == 0


def test_samples_fork_from_the_prompt_and_copy_its_last_block_on_write() -> None:
    engine = Engine(max_num_batched_tokens=8)
    request = engine.add(tokens(10), max_tokens=4, n=3, seed=5)
    assert plan(engine.step()) == [("r0", 8)]
    out = engine.step()
    assert plan(out) == [("r0", 2), ("r0.1", 0), ("r0.2", 0)]  # the others sample from the prompt's logits
    assert [s.sample_from for s in out.scheduled] == [None, request.sequences[0], request.sequences[0]]
    assert [s.seed for s in request.sequences] == [derive_seed(5, i) for i in range(3)]
    parent, *children = request.sequences
    assert all(c.block_table == parent.block_table and c.num_computed_tokens == 10 for c in children)
    shared = parent.block_table[2]
    out = engine.step()
    assert plan(out) == [("r0", 1), ("r0.1", 1), ("r0.2", 1)]
    # All three write into the shared, partly filled third block: two copies, the last writes in place.
    assert out.block_copies == [(shared, parent.block_table[2]), (shared, children[0].block_table[2])]
    assert children[1].block_table[2] == shared and len({s.block_table[2] for s in request.sequences}) == 3
    assert {tuple(s.block_table[:2]) for s in request.sequences} == {tuple(parent.block_table[:2])}
    engine.run_all()
    assert engine.block_manager.num_used_blocks == 0


# ---------------------------------------------------------------------------------------------------
# Limits and fairness under a flood


def test_forks_count_against_max_num_seqs() -> None:
    engine = Engine(max_num_seqs=4)
    a = engine.add(tokens(3), max_tokens=3, n=3, request_id="a")
    engine.add(tokens(3, 10), max_tokens=3, n=2, request_id="b")
    engine.add(tokens(3, 20), max_tokens=3, request_id="c")
    # a's prompt holds a place for each of its 3 samples: b (2) must wait, and c may not pass it.
    assert plan(engine.step()) == [("a", 3), ("a.1", 0), ("a.2", 0)]
    assert engine.scheduler.num_waiting == 3  # b and its fork to come, and c
    for out in engine.run_all():
        assert len(engine.scheduler.running) <= 4 and len(out.scheduled) <= 4
    assert engine.finished == ["a", "b", "c"] and len(a.sequences) == 3


def test_a_short_prompt_passes_long_ones_while_one_prefills_in_chunks() -> None:
    engine = Engine(num_blocks=64, max_num_batched_tokens=8)
    for name_ in ("l0", "l1", "l2"):  # one call's many long prompts, then a short chat
        engine.add(tokens(40, 100 * len(engine.requests)), max_tokens=1, request_id=name_)
    engine.add(tokens(3, 900), max_tokens=2, request_id="short")
    # l0 takes half the budget and leaves the rest to the short prompt: l1 and l2 wait for l0's prefill.
    assert plan(engine.step()) == [("l0", 4), ("short", 3)]
    assert [name(s) for s in engine.scheduler.waiting] == ["l1", "l2"]
    assert plan(engine.step()) == [("l0", 7), ("short", 1)]  # nothing short waits: l0 takes what decodes leave
    engine.run_all()
    assert engine.finished[0] == "short" and engine.finished[1:] == ["l0", "l1", "l2"]
    assert engine.block_manager.num_used_blocks == 0


def test_shorts_never_stall_the_prompt_being_chunked() -> None:
    engine = Engine(num_blocks=64, max_num_seqs=16, max_num_batched_tokens=8)
    long = engine.add(tokens(40), max_tokens=1, request_id="long").sequences[0]
    chunks = []
    while not long.is_finished:
        engine.add(tokens(4, 500 + len(chunks) * 4), max_tokens=1)  # a short prompt arrives every step
        out = engine.step()
        chunks += [s.num_new_tokens for s in out.scheduled if s.seq is long]
        assert len(chunks) < 20, "the long prompt is starved"
    assert chunks == [4] * 8 + [8]  # half of every step, and all of the one where it ends
