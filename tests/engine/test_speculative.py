"""Speculative decoding: the n-gram and suffix proposers, draft verification, and the engine's
outputs with speculation equal to those without it (greedy and seeded) on the embedded model, with
no KV block leaked. The scheduler's and block manager's side, rollbacks included: tests/engine/test_block_manager.py."""
from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import Completion, LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Request, Sequence
from engine.speculative import (MAX_SKIP, PATIENCE, DraftState, NgramProposer, SuffixAutomaton, SuffixProposer,
                                accepted, max_batch)
from tests.engine.test_llm_engine import BLOCK_BYTES, make_engine

# Text that repeats itself, so the prompt and the output hold what the next tokens will be.
CODE = ("Return this function unchanged except that it must multiply instead of add:\n\n"
        "def combine(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
        "    return total\n")
LIST = "Repeat this list twice: apples, pears, plums, cherries, apricots, peaches, figs."


def test_lookup_takes_what_followed_the_latest_match_of_the_longest_tail() -> None:
    proposer = NgramProposer(num_tokens=3, max_n=3, min_n=2)
    assert proposer.lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    # The latest earlier occurrence wins, and a 3-gram before a 2-gram.
    assert proposer.lookup([5, 2, 3, 7, 1, 2, 3, 8, 0, 2, 3], 2) == [8, 0]
    assert proposer.lookup([1, 2, 3, 6, 7, 0, 2, 3], 3) == [6, 7, 0]
    assert proposer.lookup([4, 5, 6, 7], 3) == []  # no earlier occurrence
    assert proposer.lookup([1, 2, 1, 2], 0) == []
    assert proposer.lookup([1, 2, 5, 1, 2], 3) == [5, 1, 2]  # stops at the end of what is known


def test_a_window_bounds_the_search() -> None:
    far = [1, 2, 3] + [9] * 20 + [1, 2]
    assert NgramProposer(2, window=30).lookup(far, 2) == [3, 9]
    assert NgramProposer(2, window=10).lookup(far, 2) == []


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
        assert automaton.follow(tail, 3, 2) == first_occurrence_after(tokens, tail, 3, 2)


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


def test_only_a_gpu_drafts_beside_a_batch() -> None:
    assert max_batch("cuda") > 1 and max_batch("cpu") == 1


@pytest.fixture(scope="module")
def engines(default_model_dir) -> tuple[LLMEngine, LLMEngine]:
    """The embedded model without and with n-gram speculation."""
    return make_engine(default_model_dir), make_engine(default_model_dir, speculative_method="ngram",
                                                       num_speculative_tokens=4, speculative_max_batch=8)


@pytest.fixture(scope="module", params=["ngram", "suffix"])
def spec_engines(request, default_model_dir, engines) -> tuple[LLMEngine, LLMEngine]:
    """The embedded model without speculation, and with each draft source."""
    if request.param == "ngram":
        return engines
    return engines[0], make_engine(default_model_dir, speculative_method=request.param, num_speculative_tokens=4,
                                   speculative_max_batch=8)


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


def chats(*texts: str) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": t}] for t in texts]


PROMPTS = chats(CODE, LIST, CODE, LIST)
PARAMS = [
    SamplingParams(temperature=0, max_tokens=48),
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40, logprobs=2),
    # Each draft's position keys its own noise: with any other, most of these samples differ.
    SamplingParams(temperature=0.8, seed=5, max_tokens=40, n=4),
    SamplingParams(temperature=0, max_tokens=64, stop=["figs"]),
]


@pytest.fixture(scope="module")
def plain_outputs(engines) -> list[Completion]:
    """PROMPTS under PARAMS without speculation, once for every draft source."""
    return engines[0].generate(PROMPTS, PARAMS)


def test_greedy_and_seeded_outputs_are_those_without_speculation(spec_engines, plain_outputs) -> None:
    _, spec = spec_engines
    before = spec.stats()
    expected, got = plain_outputs, spec.generate(PROMPTS, PARAMS)
    for a, b in zip(expected, got):
        assert_same(a, b)
    after = spec.stats()
    assert after.draft_tokens > before.draft_tokens
    assert after.accepted_draft_tokens > before.accepted_draft_tokens  # speculation really ran, and paid
    assert got[3].samples[0].finish_reason == "stop"  # the stop string ended a step of drafts
    assert spec.block_manager.num_used_blocks == 0


def test_preemption_and_prefix_cache_hits_keep_the_outputs(default_model_dir, engines) -> None:
    base, _ = engines
    tight = make_engine(default_model_dir, kv_cache_memory=14 * BLOCK_BYTES, speculative_method="ngram",
                        speculative_max_batch=4)
    prompts = chats(LIST, CODE, LIST + " Then stop.", "Count from one to twenty in words.")
    greedy = SamplingParams(temperature=0, max_tokens=40)
    expected = base.generate(prompts, greedy)
    for a, b in zip(expected, tight.generate(prompts, greedy)):
        assert_same(a, b)
    assert tight.stats().preemptions > 0 and tight.stats().accepted_draft_tokens > 0
    [again] = tight.generate(prompts[:1], greedy)  # served from the prefix cache this time
    assert again.usage.cached_tokens > 0
    assert_same(expected[0], again)
    assert tight.block_manager.num_used_blocks == 0


def test_aborts_leak_no_block(engines) -> None:
    _, spec = engines
    requests = [spec.add_request(p, SamplingParams(temperature=0, max_tokens=64)) for p in chats(LIST, CODE)]
    for _ in range(40):  # until a step with drafts is in flight, its blocks allocated for them
        spec.step()
        if spec._in_flight is not None and any(s.drafts for s in spec._in_flight.sampling):
            break
    else:
        pytest.fail("no step carried drafts")
    for request in requests:
        spec.abort(request.request_id)
    while spec.has_unfinished():
        spec.step()
    spec.step()  # the step in flight lands
    assert spec.block_manager.num_used_blocks == 0 and not spec.scheduler.running


def test_flags_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="speculative-method"):
        LLMEngine(EngineConfig(model="random:tiny-llama3", device="cpu", speculative_method="eagle"))
    with pytest.raises(InvalidRequestError, match="num-speculative-tokens"):
        LLMEngine(EngineConfig(model="random:tiny-llama3", device="cpu", speculative_method="ngram",
                               num_speculative_tokens=0))
