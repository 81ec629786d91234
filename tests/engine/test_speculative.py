"""Speculative decoding: the n-gram and suffix proposers, draft verification, and the engine's
outputs with speculation equal to those without it (greedy and seeded) on the embedded model, with
no KV block leaked; the draft-model method on tiny random models, its distribution included. The scheduler's and block manager's side, rollbacks included: tests/engine/test_block_manager.py."""
from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError, ModelLoadError
from engine.llm_engine import Completion, LLMEngine
from engine.sampler import SamplerOutput
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.sequence import Request, Sequence, placeholder
from engine.tokenizer import IncrementalDetokenizer
from engine.block_manager import BlockManager
from engine.scheduler import ScheduledSequence, Scheduler
from kernels.float_linear import PackedWeight
from engine.speculative import (MAX_PAUSE, MAX_SKIP, MIN_PAUSE, PATIENCE, PROBE_STEPS, WARM_STEPS, DraftState,
                                Lookahead, NgramProposer, SpeedGate, SuffixAutomaton, SuffixProposer, accepted,
                                max_batch)
from tests.engine.test_llm_engine import BLOCK_BYTES, make_engine

# Text that repeats itself, so the prompt and the output hold what the next tokens will be.
CODE = ("Return this function unchanged except that it must multiply instead of add:\n\n"
        "def combine(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
        "    return total\n")
LIST = "Repeat this list twice: apples, pears, plums, cherries, apricots, peaches, figs."


def test_lookup_takes_what_followed_the_latest_match_of_the_longest_tail() -> None:
    proposer = NgramProposer(num_tokens=3, max_n=3, min_n=2)
    assert proposer.propose(sequence([1, 2, 3, 4, 9, 1, 2, 3]), 3) == [4, 9, 1]
    # The latest earlier occurrence wins, and a 3-gram before a 2-gram.
    assert proposer.propose(sequence([5, 2, 3, 7, 1, 2, 3, 8, 0, 2, 3]), 2) == [8, 0]
    assert proposer.propose(sequence([1, 2, 3, 6, 7, 0, 2, 3]), 3) == [6, 7, 0]
    assert proposer.propose(sequence([4, 5, 6, 7]), 3) == []  # no earlier occurrence
    assert proposer.propose(sequence([1, 2, 1, 2]), 0) == []
    assert proposer.propose(sequence([1, 2, 5, 1, 2]), 3) == [5, 1, 2]  # stops at the end of what is known


def test_a_window_bounds_the_search() -> None:
    far = [1, 2, 3] + [9] * 20 + [1, 2]
    assert NgramProposer(2, window=30).propose(sequence(far), 2) == [3, 9]
    assert NgramProposer(2, window=10).propose(sequence(far), 2) == []


def latest_earlier_ngram(tokens: list[int], k: int, max_n: int, min_n: int, window: int) -> list[int]:
    """By brute force: what followed the latest earlier occurrence of the longest tail n-gram."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for i in range(length - n - 1, max(0, length - window) - 1, -1):
            if tokens[i:i + n] == tokens[length - n:]:
                return tokens[i + n:i + n + k]
    return []


@pytest.mark.parametrize("window", [4096, 40])
def test_a_sequences_index_proposes_what_a_scan_back_finds(window: int) -> None:
    """Grown a token (or a few accepted drafts) at a time, as a decoding sequence is."""
    rng = random.Random(window)
    proposer = NgramProposer(num_tokens=4, window=window)
    seq = sequence([rng.randrange(6) for _ in range(60)])
    for _ in range(150):
        assert proposer.propose(seq, 4) == latest_earlier_ngram(seq.token_ids, 4, 4, 2, window)
        seq.token_ids += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        # With the next token still being sampled: whether the real ones have a proposal.
        seq.token_ids.append(placeholder(0))
        seq.num_placeholders = 1
        assert proposer.likely(seq) == bool(latest_earlier_ngram(seq.token_ids[:-1], 1, 4, 2, window))
        seq.token_ids.pop()
        seq.num_placeholders = 0


def test_rejected_proposals_ask_for_longer_matches() -> None:
    """After each proposal rejected whole, the next needs a match one token longer (up to max_n)."""
    proposer = NgramProposer(num_tokens=2, max_n=4, min_n=2)
    seq = sequence([7, 1, 2, 3, 8, 5, 2, 3])  # only the bigram (2, 3) occurred before
    assert proposer.propose(seq, 2) == [8, 5] and proposer.likely(seq)
    seq.drafting = DraftState(2)
    seq.drafting.record(2, 0, 2)  # rejected whole: a trigram now
    assert proposer.propose(seq, 2) == [] and not proposer.likely(seq)
    seq.token_ids[5] = 1  # ... 1, 2, 3 repeats: a trigram match
    assert proposer.propose(seq, 2) == [8, 1]
    seq.drafting.record(2, 1, 2)  # accepted: bigrams again
    seq.token_ids[5] = 5
    assert seq.drafting.misses == 0 and proposer.propose(seq, 2) == [8, 5]


def test_suffix_likely_reads_only_the_real_tokens() -> None:
    rng = random.Random(3)
    proposer, seq = SuffixProposer(num_tokens=4), sequence([rng.randrange(5) for _ in range(30)])
    for _ in range(60):
        seq.token_ids.append(placeholder(0))
        seq.num_placeholders = 1
        expected = SuffixProposer(num_tokens=4).propose(sequence(seq.token_ids[:-1]), 1)
        assert proposer.likely(seq) == bool(expected)
        seq.token_ids[-1] = rng.randrange(5)
        seq.num_placeholders = 0


def first_earlier_repeat(tokens: list[int], k: int, min_match: int) -> list[int]:
    """By brute force: what followed the first earlier occurrence of the longest suffix seen before."""
    n = len(tokens)
    for length in range(n - 1, min_match - 1, -1):
        for i in range(n - length):
            if tokens[i:i + length] == tokens[n - length:]:
                return tokens[i + length:i + length + k]
    return []


def first_occurrence_after(text: list[int], tail: list[int], k: int, min_match: int) -> list[int]:
    """By brute force: what followed the first occurrence in text of tail's longest suffix found there."""
    for length in range(len(tail), min_match - 1, -1):
        for i in range(len(text) - length + 1):
            if text[i:i + length] == tail[len(tail) - length:]:
                return text[i + length:i + length + k]
    return []


def test_the_suffix_automaton_finds_the_longest_match_of_any_length() -> None:
    rng = random.Random(0)
    for _ in range(400):  # three tokens, so that lists repeat themselves at every length
        tokens = [rng.randrange(3) for _ in range(rng.randrange(40))]
        automaton = SuffixAutomaton()
        for i, token in enumerate(tokens):  # grown a token at a time, asked at every length
            automaton.extend(token)
            assert automaton.repeat(4, 2) == first_earlier_repeat(tokens[:i + 1], 4, 2)
            tail = [rng.randrange(3) for _ in range(rng.randrange(12))]
            assert automaton.follow(tail, 3, 2) == first_occurrence_after(tokens[:i + 1], tail, 3, 2)


def sequence(tokens: list[int]) -> Sequence:
    request = Request("r", tokens, SamplingParams(), 16, frozenset())
    return Sequence(request, 0, list(tokens), 0)


def test_suffix_drafts_come_from_the_sequence_then_from_recent_ones() -> None:
    proposer = SuffixProposer(num_tokens=3)
    tool_call = [50, 51, 52, 53, 54, 55, 56, 57]
    first = sequence([1, 2] + tool_call + [9])
    assert proposer.propose(first, 8) == []  # nothing repeats yet
    first.token_ids += [1, 2, 50]  # it grows: the automaton follows
    assert proposer.propose(first, 8) == [51, 52, 53]
    assert proposer.propose(first, 2) == [51, 52]  # no more than the step allows
    second = sequence([7, 7, 3, 50, 51, 52, 53])  # another request starts the same call
    assert proposer.propose(second, 8) == [54, 55, 56]
    assert proposer.propose(sequence([7, 8, 52, 53]), 8) == []  # two tokens: too short across sequences
    proposer.forget()
    assert proposer.propose(sequence([7, 7, 3, 50, 51, 52, 53]), 8) == []  # no memory of the others


def in_flight(seq: Sequence, drafts: list[int]) -> None:
    """seq as a step with `drafts` leaves it when launched: the drafts stand in its tokens, its last
    sample a placeholder (LLMEngine._launch)."""
    seq.token_ids += [*drafts, placeholder(len(drafts))]
    seq.num_placeholders += len(drafts) + 1


@pytest.mark.parametrize("proposer", [NgramProposer(num_tokens=3), SuffixProposer(num_tokens=3)],
                         ids=["ngram", "suffix"])
def test_drafts_past_a_step_in_flight_follow_a_guess_of_its_last_sample(proposer) -> None:
    text = [60, 61, 62, 63, 64, 65, 66, 67, 68]
    seq = sequence([1, 2, *text, 9, 60, 61])
    assert proposer.propose(seq, 8) == [62, 63, 64]
    in_flight(seq, [62, 63])  # a placeholder for 64, guessed: the drafts follow it
    assert proposer.propose(seq, 8) == [65, 66, 67]
    assert proposer.propose(seq, 2) == [65, 66]
    # The drafts were rejected: they are gone, and the index or automaton took in real tokens only
    # (it would have found "61 62" where the drafts were, now followed by other tokens).
    del seq.token_ids[-3:]
    seq.num_placeholders = 0
    seq.token_ids += [5, 5]
    assert proposer.propose(seq, 8) == []
    seq.token_ids += [61, 62]
    assert proposer.propose(seq, 8) == [63, 64, 65]


def test_the_lookahead_asks_for_the_progress_that_the_time_it_saves_is_worth() -> None:
    lookahead = Lookahead(weight=0.5)
    lookahead.record(host=0.3e-3, device=None)
    assert lookahead.min_progress == 1.0  # unmeasured: nothing goes ahead
    lookahead.record(host=0.3e-3, device=1.0e-3)  # steps of 1.0 ms instead of 1.3
    assert lookahead.min_progress == pytest.approx(1 / 1.3)
    lookahead.record(host=0.1e-3, device=1.0e-3)  # moving averages: 0.2 of 1.0
    assert lookahead.min_progress == pytest.approx(1 / 1.2)
    lookahead.record(host=5e-3, device=1.0e-3)  # a host slower than the device still bounds the step
    assert lookahead.min_progress == pytest.approx(2.6 / 3.6)


def drafting(params: SamplingParams | None = None, drafts: tuple[int, ...] = (4, 5)) -> ScheduledSequence:
    """A sequence's step in flight, with drafts (none: a plain decode)."""
    seq = Sequence(Request("r", [1, 2, 3], params or SamplingParams(), 16, frozenset()), 0, [1, 2, 3], 0)
    seq.drafting = DraftState(length=4)
    return ScheduledSequence(seq, 1 + len(drafts), samples=True, drafts=list(drafts))


def test_a_step_goes_ahead_of_drafts_that_are_confirmed_whole_often_enough() -> None:
    lookahead = Lookahead()
    lookahead.min_progress = 1 / 1.3  # the host's work is 0.3 of the device's step
    scheduler = Scheduler(BlockManager(8, 16), 4, 64, NgramProposer(num_tokens=4), lookahead=lookahead)
    step = drafting()
    state = step.seq.drafting
    for _ in range(3):
        state.record(drafted=4, confirmed=4, most=4)
    assert not scheduler.goes_ahead([step])  # its gate has not timed steps that waited yet
    for _ in range(WARM_STEPS):
        lookahead.gate.record(False, 1, 5, 1e-3)
    assert scheduler.goes_ahead([step])
    lookahead.gate = None  # the account alone, below
    step = drafting()
    state = step.seq.drafting
    # Alone, a sequence moves in 1 / (2 - p) of the steps: it goes ahead from p = 0.7.
    assert state.odds_whole == 0.5 and not scheduler.goes_ahead([step])  # no record yet: even odds
    for _ in range(3):
        state.record(drafted=4, confirmed=4, most=4)
    assert state.odds_whole == pytest.approx(3.71 / 4.71) and scheduler.goes_ahead([step])
    state.record(drafted=4, confirmed=1, most=4)  # the newest weighs most
    assert state.odds_whole == pytest.approx(3.439 / 5.439) and not scheduler.goes_ahead([step])
    assert scheduler.goes_ahead([step, drafting(drafts=())])  # beside a plain decode, which always moves
    for _ in range(50):
        state.record(drafted=4, confirmed=4, most=4)
    assert state.odds_whole < 11 / 12  # a record of 10 proposals at most
    for params in (SamplingParams(presence_penalty=0.5), SamplingParams(structured=StructuredOutput("regex", "a+"))):
        other = drafting(params)
        assert not scheduler.guesses(other.seq)  # their drafts need the real ids: they wait for them
        assert not scheduler.goes_ahead([step, other]) and scheduler.goes_ahead([step, drafting(params, ())])
    assert Scheduler(BlockManager(8, 16), 4, 64, SuffixProposer(4), lookahead=Lookahead()).lookahead is not None
    assert Scheduler(BlockManager(8, 16), 4, 64, None, lookahead=Lookahead()).lookahead is None  # nothing drafts


def test_drafts_are_accepted_up_to_the_first_that_the_target_did_not_sample() -> None:
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted([4, 5, 6], [4, 0, 6, 7]) == 1
    assert accepted([4], [3, 4]) == 0


def test_draft_length_follows_acceptance_and_misses_back_off() -> None:
    state = DraftState(length=4)
    state.record(drafted=4, confirmed=1, most=4)
    assert (state.length, state.skip) == (4, 0)  # an accepted draft keeps the drafts long
    lengths, skips = [], []
    for _ in range(PATIENCE + 5):  # rejected whole: half as many next; from PATIENCE in a row, skips that double
        state.record(drafted=state.length, confirmed=0, most=4)
        lengths.append(state.length)
        skips.append(state.skip)
        state.skip = 0
    assert lengths == [2] + [1] * (PATIENCE + 4)
    assert skips == [0] * (PATIENCE - 1) + [1, 2, 4, 8, 16, 16] and MAX_SKIP == 16
    state.record(drafted=1, confirmed=1, most=4)
    assert (state.misses, state.length) == (0, 4)
    dry = []
    for _ in range(PATIENCE + 1):  # nothing to propose, again and again: the same back-off
        state.record(drafted=0, confirmed=0, most=4)
        dry.append(state.skip)
        state.skip = 0
    assert dry == [0] * (PATIENCE - 1) + [1, 2] and state.length == 4
    state.record(drafted=4, confirmed=0, most=4)
    assert (state.dry, state.skip) == (0, 0)


def test_the_speed_gate_pauses_drafts_that_do_not_pay() -> None:
    gate = SpeedGate()
    for _ in range(WARM_STEPS):  # first the batch size's pace without drafts: 2 tokens a second a sequence
        assert not gate.open(4) and gate.tick(4) is False
        gate.record(False, 4, tokens=8, seconds=1.0)
    assert gate.open(4) and gate.open(3) and not gate.open(5)  # batch sizes by powers of two
    pauses = []
    for _ in range(4):  # drafts that bring 1.5 tokens a second a sequence: paused, twice as long each time
        for _ in range(PROBE_STEPS):
            assert gate.tick(4)
            gate.record(True, 4, tokens=6, seconds=1.0)
        pauses.append(sum(1 for _ in iter(lambda: gate.tick(4), True)))
        assert gate.open(4)
    assert pauses == [MIN_PAUSE, 2 * MIN_PAUSE, 4 * MIN_PAUSE, 8 * MIN_PAUSE] and 8 * MIN_PAUSE <= MAX_PAUSE
    for _ in range(2 * PROBE_STEPS):  # after a pause they are timed afresh: now they pay, so no pause
        gate.record(True, 4, tokens=12, seconds=1.0)
        assert gate.tick(4)
    assert gate.paces[4].next_pause == MIN_PAUSE


def test_drafting_stops_where_verify_steps_are_slow() -> None:
    """On a clock where a decode step takes 10 ms and a verify step 100 ms (at most 5 tokens, where
    a decode step makes 10 in that time), the engine drafts only in its gate's probes, each followed
    by a pause that doubles: two probes in 136 tokens, where a third would start at token 128 if the
    second pause were no longer than the first. (One sequence, under a gate that times batch 1 too;
    a stub model that carries on its prompt's cycle, so that every draft is accepted: drafting's best
    case still loses.)"""
    slow = LLMEngine(EngineConfig(model="random:tiny-llama3", device="cpu", kv_cache_memory="16MiB",
                                  speculative_method="ngram", num_speculative_tokens=4, speculative_max_batch=8))
    slow.scheduler.gate = SpeedGate(min_batch=1)
    now, launches = [0.0], []
    cycle = [300 + 7 * i for i in range(16)]

    def forward(step, prev, rows=None):  # a stub model, timed: one sequence, so 1 + its drafts rows
        verify = step.decodes and len(step.input_ids) > 1
        now[0] += 0.1 if verify else 0.01
        launches.append("V" if verify else ".")
        n = len(step.logit_rows) + len(step.prompt_rows)
        return torch.zeros(n, 512) if n else None

    slow.runner.forward, slow.clock = forward, lambda: now[0]
    slow.runner.sample = lambda logits, rows, mask=None: SamplerOutput(
        torch.tensor([cycle[row.counter % 16] for row in rows], dtype=torch.int64))
    [result] = slow.generate([cycle * 4], SamplingParams(temperature=0, max_tokens=136, ignore_eos=True))
    assert result.token_ids == (cycle * 9)[:136]
    pace = slow.scheduler.gate.paces[1]
    assert pace.plain_steps >= WARM_STEPS + MIN_PAUSE and pace.next_pause >= 4 * MIN_PAUSE  # paused twice
    # Each probe's PROBE_STEPS timed steps, and the one launched in the step() that records its verdict.
    probes = re.findall("V+", "".join(launches))
    assert len(probes) == 2 and all(PROBE_STEPS <= len(p) <= PROBE_STEPS + 1 for p in probes), launches
    assert 0 < slow.stats().accepted_draft_tokens == slow.stats().draft_tokens <= 4 * 2 * (PROBE_STEPS + 1)
    assert slow.block_manager.num_used_blocks == 0
    slow.close()


def test_the_speed_gate_leaves_a_sequence_alone_to_its_draft_state() -> None:
    gate = SpeedGate()
    for _ in range(4 * PROBE_STEPS):  # drafts at batch 1 that lose: neither timed nor paused
        assert gate.open(1) and gate.tick(1)
        gate.record(True, 1, tokens=1, seconds=1.0)
        gate.record(False, 1, tokens=10, seconds=1.0)
    assert gate.paces == {} and not gate.open(2)


def test_only_a_gpu_drafts_beside_a_batch() -> None:
    assert max_batch("cuda") > 1 and max_batch("cpu") == 1


@pytest.fixture(scope="module")
def engines(default_model_dir) -> tuple[LLMEngine, LLMEngine]:
    """The embedded model without and with n-gram speculation."""
    return make_engine(default_model_dir), make_engine(default_model_dir, speculative_method="ngram",
                                                       num_speculative_tokens=4, speculative_max_batch=8,
                                                       speculative_gate=False)


# Each draft source waiting for the step in flight, and one going ahead of it: the lookahead is the
# engine's, the same for both; the n-gram index's guesses past a step in flight (and its rollbacks)
# are test_drafts_past_a_step_in_flight_follow_a_guess_of_its_last_sample's.
@pytest.fixture(scope="module", params=["ngram", "suffix", "suffix-overlap"])
def spec_engines(request, default_model_dir, engines) -> tuple[LLMEngine, LLMEngine]:
    """The embedded model without speculation, and with each draft source, steps with drafts waiting
    for the step in flight or going ahead of it (overlap)."""
    if request.param == "ngram":
        return engines
    method, _, overlap = request.param.partition("-")
    spec = make_engine(default_model_dir, speculative_method=method, num_speculative_tokens=4, speculative_max_batch=8,
                       speculative_gate=False, speculative_overlap=bool(overlap))
    if overlap:
        always_ahead(spec)
    return engines[0], spec


def always_ahead(engine: LLMEngine) -> None:
    """Every step goes ahead of its step with drafts, whatever its luck: the most rollbacks (on a
    CPU the measured lookahead lets few go)."""
    engine.scheduler.lookahead.record = lambda host, device: None
    engine.scheduler.lookahead.min_progress = 0.0
    engine.scheduler.lookahead.gate = None


@pytest.fixture
def rollbacks(monkeypatch) -> dict[str, int]:
    """Counts of steps with drafts read while a step launched on them was in flight, and of those
    whose drafts the target rejected in part, which made that step's rows stale."""
    counts = {"ahead": 0, "stale": 0}
    accept = LLMEngine._accept

    def counted(self, s, start, sampled, logprobs, first, launched):
        taken = accept(self, s, start, sampled, logprobs, first, launched)
        if launched is not None and any(t.seq is s.seq for t in launched.sampling):
            counts["ahead"] += 1
            counts["stale"] += any(t.stale for t in launched.sampling if t.seq is s.seq)
        return taken

    monkeypatch.setattr(LLMEngine, "_accept", counted)
    return counts


def assert_same(a: Completion, b: Completion) -> None:
    assert a.samples.keys() == b.samples.keys()
    for index, sample in a.samples.items():
        other = b.samples[index]
        assert (other.token_ids, other.text, other.finish_reason) == (sample.token_ids, sample.text,
                                                                       sample.finish_reason)
        assert [lp.token_id for lp in other.logprobs] == [lp.token_id for lp in sample.logprobs]
        for lp, olp in zip(sample.logprobs, other.logprobs):
            assert olp.logprob == pytest.approx(lp.logprob, abs=1e-3)
            assert [t for t, _ in olp.top] == [t for t, _ in lp.top]
    assert b.usage.completion_tokens == a.usage.completion_tokens  # tokens past a stop string dropped


def chats(*texts: str) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": t}] for t in texts]


PROMPTS = chats(CODE, LIST, CODE, LIST)
# 28 tokens: the seeded requests and the greedy one that stops have drafts proposed and accepted by
# then (the greedy CODE one, which never drafts, stays as a row without drafts beside them).
PARAMS = [
    SamplingParams(temperature=0, max_tokens=28),
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=28, logprobs=2),
    # Each draft's position keys its own noise: with any other, most of these samples differ.
    SamplingParams(temperature=0.8, seed=5, max_tokens=28, n=4),
    SamplingParams(temperature=0, max_tokens=64, stop=["figs"]),
]


@pytest.fixture(scope="module")
def plain_outputs(engines) -> list[Completion]:
    """PROMPTS under PARAMS without speculation, once for every draft source."""
    return engines[0].generate(PROMPTS, PARAMS)


def test_greedy_and_seeded_outputs_are_those_without_speculation(spec_engines, plain_outputs, rollbacks) -> None:
    _, spec = spec_engines
    before = spec.stats()
    expected, got = plain_outputs, spec.generate(PROMPTS, PARAMS)
    for a, b in zip(expected, got):
        assert_same(a, b)
    after = spec.stats()
    assert after.draft_tokens > before.draft_tokens
    assert after.accepted_draft_tokens > before.accepted_draft_tokens  # speculation really ran, and paid
    if spec.scheduler.lookahead is not None:  # steps went ahead of steps with drafts, and some were rolled back
        assert rollbacks["ahead"] > rollbacks["stale"] > 0, rollbacks
    else:
        assert rollbacks["ahead"] == 0
    assert got[3].samples[0].finish_reason == "stop"  # the stop string ended a step of drafts
    emitted = sum(len(sample.token_ids) for c in got for sample in c.samples.values())
    assert after.generation_tokens - before.generation_tokens == emitted
    assert spec.block_manager.num_used_blocks == 0


def test_steps_go_ahead_of_drafts_only_where_asked() -> None:
    def lookahead(**kw) -> Lookahead | None:
        engine = LLMEngine(EngineConfig(model="random:tiny-llama3", device="cpu", kv_cache_memory="2MiB", **kw))
        engine.close()
        return engine.scheduler.lookahead

    assert lookahead(speculative_method="ngram") is None
    assert isinstance(lookahead(speculative_method="suffix", speculative_overlap=True), Lookahead)
    assert lookahead(speculative_overlap=True) is None  # nothing drafts
    # A draft model's drafts follow real ids: its steps wait.
    assert lookahead(speculative_method="draft", speculative_model="random:tiny-llama3-draft",
                     speculative_overlap=True) is None


TIGHT_PROMPTS = chats(LIST, CODE, LIST + " Then stop.", "Count from one to twenty in words.")
TIGHT_GREEDY = SamplingParams(temperature=0, max_tokens=32)  # with their prompts, well past 14 blocks


@pytest.fixture(scope="module")
def tight_expected(engines) -> list[Completion]:
    """TIGHT_PROMPTS without speculation, once for both ways of stepping."""
    return engines[0].generate(TIGHT_PROMPTS, TIGHT_GREEDY)


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_and_prefix_cache_hits_keep_the_outputs(default_model_dir, tight_expected, overlap) -> None:
    tight = make_engine(default_model_dir, kv_cache_memory=14 * BLOCK_BYTES, speculative_method="ngram",
                        speculative_max_batch=4, speculative_gate=False, speculative_overlap=overlap)
    if overlap:
        always_ahead(tight)
    for a, b in zip(tight_expected, tight.generate(TIGHT_PROMPTS, TIGHT_GREEDY)):
        assert_same(a, b)
    assert tight.stats().preemptions > 0 and tight.stats().accepted_draft_tokens > 0
    [again] = tight.generate(TIGHT_PROMPTS[:1], TIGHT_GREEDY)  # served from the prefix cache this time
    assert again.usage.cached_tokens > 0
    assert_same(tight_expected[0], again)
    assert tight.block_manager.num_used_blocks == 0


def test_penalized_requests_draft_too(engines) -> None:
    # Each draft's row counts the drafts before it in its history, as the step after them would
    # (the same rows for every draft source). Mild penalties, so that the text still repeats itself.
    # Both in one batch, each with its own history; both draft within their first 32 tokens.
    base, spec = engines
    params = [SamplingParams(temperature=0, max_tokens=32, frequency_penalty=0.02),
              SamplingParams(temperature=0.7, seed=3, max_tokens=32, presence_penalty=0.05, repetition_penalty=1.01)]
    before = spec.stats()
    for expected, got in zip(base.generate(chats(LIST, LIST), params), spec.generate(chats(LIST, LIST), params)):
        assert_same(expected, got)
    assert spec.stats().accepted_draft_tokens > before.accepted_draft_tokens


# An array of like objects: its keys and punctuation repeat, which the lookups draft.
TODO_SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "minItems": 2, "maxItems": 3, "items": {
        "type": "object", "required": ["fruit", "ripe"],
        "properties": {"fruit": {"type": "string", "maxLength": 12}, "ripe": {"type": "boolean"}}}}}}


def test_the_grammar_masks_each_draft_row(engines) -> None:
    # Each draft's row is masked by the grammar after the drafts before it (grammar_worker.py), and
    # the matcher takes only the tokens kept: outputs are those without speculation, and valid.
    base, spec = engines
    structured = StructuredOutput.json_schema(TODO_SCHEMA)
    params = [SamplingParams(temperature=0.8, seed=9, max_tokens=120, structured=structured),
              SamplingParams(temperature=0, max_tokens=8, structured=StructuredOutput("regex", r"(ab){2,6}c"))]
    prompts = chats(LIST + " Answer in JSON.", "Write ababab then c.")
    before = spec.stats()
    expected, got = base.generate(prompts, params), spec.generate(prompts, params)
    for a, b in zip(expected, got):
        assert_same(a, b)
    assert spec.stats().accepted_draft_tokens > before.accepted_draft_tokens
    assert len(json.loads(got[0].text)["items"]) >= 2
    assert spec.block_manager.num_used_blocks == 0


def test_aborts_leak_no_block(spec_engines) -> None:
    _, spec = spec_engines
    requests = [spec.add_request(p, SamplingParams(temperature=0, max_tokens=64)) for p in chats(LIST, CODE)]
    for _ in range(40):  # until a step with drafts is in flight (launched ahead of one, with overlap)
        spec.step()
        launched = spec._in_flight
        if (launched is not None and any(s.drafts for s in launched.sampling)
                and (spec.scheduler.lookahead is None or launched.ahead)):
            break
    else:
        pytest.fail("no step carried drafts")
    for request in requests:
        spec.abort(request.request_id)
    while spec.has_unfinished():
        spec.step()
    spec.step()  # the step in flight lands
    assert spec.block_manager.num_used_blocks == 0 and not spec.scheduler.running


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL packs the weights")
def test_cpu_verify_steps_read_packed_weights_and_keep_a_query_a_sequence(engines, monkeypatch) -> None:
    plain, spec = engines
    assert spec.model.layers[0].qkv_proj.packed.rows == 5 and spec.model.head_packed is not None
    assert plain.model.layers[0].qkv_proj.packed is None and plain.model.head_packed is None
    steps, packed_rows = [], []
    forward, call = spec.runner.forward, PackedWeight.__call__
    monkeypatch.setattr(spec.runner, "forward", lambda step, prev, rows=None: steps.append(step) or forward(step, prev, rows))
    monkeypatch.setattr(PackedWeight, "__call__", lambda self, x, bias: packed_rows.append(len(x)) or call(self, x, bias))
    params = [SamplingParams(temperature=0, max_tokens=48)]
    assert_same(plain.generate(chats(LIST), params)[0], spec.generate(chats(LIST), params)[0])
    verify = [s for s in steps if s.decodes and len(s.input_ids) > 1]
    assert verify and all(s.query_lens == [len(s.input_ids)] and s.fresh is None for s in verify)
    assert packed_rows and set(packed_rows) <= {4, 5}


def test_a_step_with_drafts_launches_before_the_text_of_the_step_it_read(default_model_dir, monkeypatch) -> None:
    # Its host work is all on the device's critical path (it waits for the step before it), so the
    # detokenizer and the outputs of the step it read run after its launch (LLMEngine._emit).
    engine = LLMEngine(EngineConfig(model="random:tiny-llama3", tokenizer=str(default_model_dir), device="cpu",
                                    kv_cache_memory="16MiB", speculative_method="ngram", speculative_gate=False))
    events: list[str] = []
    cycle = [300 + 7 * i for i in range(16)]  # merged pieces of the embedded vocabulary: each has text

    def forward(step, prev, rows=None):  # a stub model: the tokens that carry on the prompt's cycle
        events.append("launch")
        n = len(step.logit_rows) + len(step.prompt_rows)
        return torch.zeros(n, 512) if n else None

    engine.runner.forward = forward
    engine.runner.sample = lambda logits, rows, mask=None: SamplerOutput(
        torch.tensor([cycle[row.counter % 16] for row in rows], dtype=torch.int64))
    add = IncrementalDetokenizer.add
    monkeypatch.setattr(IncrementalDetokenizer, "add", lambda self, token_id: events.append("text") or add(self, token_id))
    request = engine.add_request(cycle * 4, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    steps = []
    while engine.has_unfinished():
        events.clear()
        engine.step()
        steps.append(list(events))
    assert request.sequences[0].output_token_ids == (cycle * 3)[:40] and engine.stats().accepted_draft_tokens >= 20
    both = [step for step in steps if "launch" in step and "text" in step]  # a step launched, one read
    assert len(both) >= 8 and all(step.index("launch") < step.index("text") for step in both)
    assert engine.block_manager.num_used_blocks == 0
    engine.close()


def test_flags_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="speculative-method"):
        LLMEngine(EngineConfig(model="random:tiny-llama3", device="cpu", speculative_method="eagle"))
    with pytest.raises(InvalidRequestError, match="num-speculative-tokens"):
        LLMEngine(EngineConfig(model="random:tiny-llama3", device="cpu", speculative_method="ngram",
                               num_speculative_tokens=0))


# ---- the draft-model method: a second model's drafts (engine/draft_model.py) ---------------------

TINY = "random:tiny-llama3"
DRAFT = "random:tiny-llama3-draft"  # TINY's first layer: its drafts are often, not always, accepted
OTHER = "random:tiny-qwen2"  # another family of the same vocabulary: its greedy drafts are all rejected
TINY_BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4  # one 16-token block of either tiny shape's KV in float32
TINY_PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 301, 302, 303, 304, 305, 306] * 3, [1, 5, 9], [1, 250] * 20]
TINY_PARAMS = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=32, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=5, max_tokens=24, n=3, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=8, seed=2, max_tokens=36, stop_token_ids=[77], ignore_eos=True),
]


def tiny_engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=TINY, device="cpu", **{"kv_cache_memory": "2MiB", **kw}))


def draft_engine(draft: str = DRAFT, **kw) -> LLMEngine:
    return tiny_engine(speculative_method="draft", speculative_model=draft, speculative_max_batch=256,
                       speculative_gate=False, **kw)


def assert_no_draft_block_held(engine: LLMEngine) -> None:
    proposer = engine.scheduler.proposer
    assert len(proposer.free_blocks) == proposer.num_blocks and not proposer._kv
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("draft", [TINY, DRAFT, OTHER])
def test_draft_model_outputs_are_those_without_speculation(draft) -> None:
    """A batch mix (greedy, seeded with logprobs, n > 1, a stop token), then a tight KV pool that
    preempts, then a prefix-cache hit: drafts from the target itself (all accepted), from its first
    layer, or from another model (many rejected)."""
    base, spec = tiny_engine(), draft_engine(draft)
    for a, b in zip(base.generate(TINY_PROMPTS, TINY_PARAMS), spec.generate(TINY_PROMPTS, TINY_PARAMS)):
        assert_same(a, b)
    stats = spec.stats()
    assert 0 < stats.accepted_draft_tokens
    assert (stats.accepted_draft_tokens == stats.draft_tokens) == (draft == TINY)
    assert_no_draft_block_held(spec)
    tight = draft_engine(draft, kv_cache_memory=14 * 2 * TINY_BLOCK_BYTES, max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = base.generate(TINY_PROMPTS, greedy)
    for a, b in zip(expected, tight.generate(TINY_PROMPTS, greedy)):
        assert_same(a, b)
    assert tight.stats().preemptions > 0 and tight.stats().draft_tokens > 0
    [again] = tight.generate(TINY_PROMPTS[1:2], greedy)
    assert again.usage.cached_tokens > 0
    assert_same(expected[1], again)
    assert_no_draft_block_held(tight)


def test_draft_model_outputs_on_the_embedded_model(default_model_dir, plain_outputs) -> None:
    """The embedded model drafting for itself (a mechanics check: all drafts accepted), on two of the
    shared prompts: seeded with logprobs, and a stop string (the tiny models' tests have the rest)."""
    spec = make_engine(default_model_dir, speculative_method="draft", speculative_model=str(default_model_dir),
                       num_speculative_tokens=4, speculative_max_batch=8, speculative_gate=False)
    got = spec.generate(PROMPTS[1::2], PARAMS[1::2])
    for a, b in zip(plain_outputs[1::2], got):
        assert_same(a, b)
    assert spec.stats().accepted_draft_tokens > 0 and got[1].samples[0].finish_reason == "stop"
    assert_no_draft_block_held(spec)


def test_aborts_leak_no_draft_block() -> None:
    spec = draft_engine()
    requests = [spec.add_request(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
                for p in TINY_PROMPTS]
    for _ in range(40):
        spec.step()
        if spec._in_flight is not None and any(s.drafts for s in spec._in_flight.sampling):
            break
    else:
        pytest.fail("no step carried drafts")
    assert len(spec.scheduler.proposer.free_blocks) < spec.scheduler.proposer.num_blocks
    for request in requests:
        spec.abort(request.request_id)
    while spec.has_unfinished():
        spec.step()
    spec.step()
    assert_no_draft_block_held(spec)


def test_forks_share_their_prompts_draft_blocks() -> None:
    """n samples of one prompt: the first to draft feeds the prompt to the draft model, the others
    share its full blocks (the draft model sees the prompt about once, not n times); the outputs
    are those without speculation and every block comes back."""
    prompt = [1] + [300 + i % 24 for i in range(70)]  # 71 tokens: 4 full blocks of 16
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=30, n=4, ignore_eos=True)
    base, spec = tiny_engine(), draft_engine()
    proposer = spec.scheduler.proposer
    fed, shared, forward = [0], [0], proposer.runner.forward

    def counted(step, prev, rows=None):
        if prev is None:  # a catch-up step: the tokens the draft KV lacked
            fed[0] += len(step.input_ids)
        tables = [b for kv in proposer._kv.values() for b in kv.blocks]
        shared[0] = max(shared[0], len(tables) - len(set(tables)))
        return forward(step, prev, rows)

    proposer.runner.forward = counted
    [want], [got] = base.generate([prompt], params), spec.generate([prompt], params)
    assert_same(want, got)
    assert spec.stats().accepted_draft_tokens > 0
    assert shared[0] >= 3 * 4  # three forks held the first one's 4 prompt blocks
    assert fed[0] < 2 * len(prompt) + 4 * 30  # the prompt about once, then each fork's own tokens
    assert_no_draft_block_held(spec)


def test_a_short_draft_pool_proposes_nothing_rather_than_fail() -> None:
    spec = draft_engine(TINY)
    spec.scheduler.proposer.free_blocks.clear()  # as if other sequences held every draft block
    base = tiny_engine()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for a, b in zip(base.generate(TINY_PROMPTS, params), spec.generate(TINY_PROMPTS, params)):
        assert_same(a, b)
    assert spec.stats().draft_tokens == 0


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """The chi-square test's p-value (Wilson-Hilferty's normal approximation of the tail)."""
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(expected) - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_draft_model_keeps_the_target_distribution() -> None:
    """2,000 distinctly seeded samples of 3 tokens at temperature 1, top_k 3, drafted by TINY's
    first layer (about 40% accepted): the third token is the first that follows a draft, so the
    (t1, t2, t3) triples must follow the target's own probabilities, computed from its logits (raw
    top-3 logprobs, renormalized as top_k does)."""
    base, spec = tiny_engine(), draft_engine()
    prompt, k = [1, 17, 42, 99, 7], 3

    def next_probs(context: list[int]) -> dict[int, float]:
        [out] = base.generate([prompt + context], SamplingParams(temperature=0, max_tokens=1, logprobs=k))
        top = out.samples[0].logprobs[0].top
        total = sum(math.exp(lp) for _, lp in top)
        return {t: math.exp(lp) / total for t, lp in top}

    expected: dict[tuple[int, ...], float] = {}
    for t1, p1 in next_probs([]).items():
        for t2, p2 in next_probs([t1]).items():
            for t3, p3 in next_probs([t1, t2]).items():
                expected[(t1, t2, t3)] = p1 * p2 * p3
    n = 2000
    params = [SamplingParams(temperature=1.0, top_k=k, seed=seed, max_tokens=3, ignore_eos=True) for seed in range(n)]
    counts: dict[tuple[int, ...], int] = {}
    for result in spec.generate([prompt] * n, params):
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(expected)
    stats = spec.stats()
    assert stats.draft_tokens >= n / 2 and 0 < stats.accepted_draft_tokens < stats.draft_tokens
    cells = sorted(expected, key=expected.get)
    rare = [c for c in cells if expected[c] * n < 5]  # pooled: the test wants 5 expected a cell
    common = [c for c in cells if c not in rare]
    observed = [counts.get(c, 0) for c in common] + ([sum(counts.get(c, 0) for c in rare)] if rare else [])
    wanted = [expected[c] * n for c in common] + ([sum(expected[c] for c in rare) * n] if rare else [])
    assert chi_square_p(observed, wanted) > 1e-3
    assert_no_draft_block_held(spec)


def test_draft_flags_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="speculative-model") as e:
        LLMEngine(EngineConfig(model=TINY, device="cpu", speculative_method="draft"))
    assert e.value.param == "speculative_model"
    with pytest.raises(InvalidRequestError, match="speculative-model"):
        LLMEngine(EngineConfig(model=TINY, device="cpu", speculative_method="ngram", speculative_model=TINY))
    with pytest.raises(InvalidRequestError, match="speculative-model"):
        LLMEngine(EngineConfig(model=TINY, device="cpu", speculative_model=TINY))
    with pytest.raises(InvalidRequestError, match="tensor-parallel-size"):
        LLMEngine(EngineConfig(model=TINY, device="cpu", speculative_method="draft", speculative_model=TINY,
                               tensor_parallel_size=2))
    with pytest.raises(ModelLoadError, match="vocabulary"):  # 49,152 ids against the target's 512
        LLMEngine(EngineConfig(model=TINY, device="cpu", speculative_method="draft",
                               speculative_model="random:smollm2-135m"))
