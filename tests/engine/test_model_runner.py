"""ModelRunner's host side: cache slots and how a step is laid out (the forward itself is covered
through the engine's tests)."""
from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import cache_slots
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Request, Sequence


@pytest.mark.parametrize("start,end", [(0, 300), (5, 300), (16, 17), (15, 17), (31, 32), (40, 40)])
def test_cache_slots_are_each_positions_block_and_offset(start: int, end: int) -> None:
    block_size = 16
    table = random.Random(start).sample(range(1000), 20)  # scattered blocks
    assert cache_slots(table, start, end, block_size) == [
        table[p // block_size] * block_size + p % block_size for p in range(start, end)]


@pytest.fixture(scope="module")
def runner():
    return LLMEngine(EngineConfig(model="random:tiny-llama3", device="cpu", block_size=16)).runner


def scheduled(token_ids: list[int], computed: int, table: list[int], new: int, drafts: tuple[int, ...] = ()
              ) -> ScheduledSequence:
    request = Request("r", token_ids[:2], SamplingParams(), 16, frozenset())
    seq = Sequence(request, 0, token_ids, seed=0, num_computed_tokens=computed, block_table=table)
    return ScheduledSequence(seq, new, samples=computed + new - len(drafts) == len(token_ids), drafts=list(drafts))


def test_a_verify_step_is_laid_out_as_decode_rows(runner) -> None:
    verify = scheduled([1, 2, 3, 4, 5], 4, [7], 3, drafts=(6, 8))
    decode = scheduled([1, 2, 3, 9], 3, [5], 1)
    step = runner.prepare(SchedulerOutput([verify, decode]), None)
    assert step.input_ids == [5, 6, 8, 9] and step.positions == [4, 5, 6, 3]
    assert step.slots == [7 * 16 + 4, 7 * 16 + 5, 7 * 16 + 6, 5 * 16 + 3]
    # A row a token, each attending up to itself, the drafts' keys read after the wait like the newest's.
    assert step.query_lens == [1, 1, 1, 1] and step.seq_lens == [5, 6, 7, 4] and step.fresh == [4, 4, 4, 3]
    assert step.block_tables == [[7], [7], [7], [5]] and step.logit_rows == [0, 1, 2, 3]


def test_a_step_with_a_prefill_chunk_keeps_a_row_a_sequence(runner) -> None:
    verify = scheduled([1, 2, 3, 4, 5], 4, [7], 3, drafts=(6, 8))
    chunk = scheduled([1, 2, 3, 4, 5, 6], 2, [5], 3)  # not its prompt's end: samples nothing
    step = runner.prepare(SchedulerOutput([verify, chunk]), None)
    assert step.query_lens == [3, 3] and step.seq_lens == [7, 5] and step.fresh is None
    assert step.logit_rows == [0, 1, 2] and step.graph_batch is None
