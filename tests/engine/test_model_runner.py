"""ModelRunner's host side: cache slots and how a step is laid out (the forward itself is covered
through the engine's tests)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import engine.model_runner as model_runner
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import _HostRing, _InputRing, cache_slots, inputs_with_tables
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Request, Sequence
from kernels.staging import stage_ref


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


@pytest.mark.parametrize("triton", [True, False])
def test_a_verify_step_is_laid_out_as_decode_rows_where_triton_runs(runner, monkeypatch, triton) -> None:
    if triton:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    verify = scheduled([1, 2, 3, 4, 5], 4, [7], 3, drafts=(6, 8))
    decode = scheduled([1, 2, 3, 9], 3, [5], 1)
    step = runner.prepare(SchedulerOutput([verify, decode]), None)
    assert step.input_ids == [5, 6, 8, 9] and step.positions == [4, 5, 6, 3]
    assert step.slots == [7 * 16 + 4, 7 * 16 + 5, 7 * 16 + 6, 5 * 16 + 3] and step.logit_rows == [0, 1, 2, 3]
    if triton:  # a row a token, each attending up to itself, the drafts' keys read after the wait like the newest's
        assert step.query_lens == [1, 1, 1, 1] and step.seq_lens == [5, 6, 7, 4] and step.fresh == [4, 4, 4, 3]
        assert step.block_tables == [[7], [7], [7], [5]]
    else:  # the torch reference: a query a sequence, which gathers its keys once
        assert step.query_lens == [3, 1] and step.seq_lens == [7, 4] and step.fresh is None
        assert step.block_tables == [[7], [5]]


def test_a_step_with_a_prefill_chunk_keeps_a_row_a_sequence(runner) -> None:
    verify = scheduled([1, 2, 3, 4, 5], 4, [7], 3, drafts=(6, 8))
    chunk = scheduled([1, 2, 3, 4, 5, 6], 2, [5], 3)  # not its prompt's end: samples nothing
    step = runner.prepare(SchedulerOutput([verify, chunk]), None)
    assert step.query_lens == [3, 3] and step.seq_lens == [7, 5] and step.fresh is None
    assert step.logit_rows == [0, 1, 2] and step.graph_batch is None


def test_a_decode_graphs_tables_ride_in_its_input_copy_while_they_are_short(monkeypatch) -> None:
    """The host buffer, laid over a decode graph's device buffer (int64 inputs [8, batch], then int32
    tables [batch, max_blocks]), holds the inputs and each row's blocks; entries a row does not use
    are the scratch block, and rows past the step's stay as they were."""
    batch, max_blocks, scratch = 4, 6, 99
    inputs = np.arange(8 * batch, dtype=np.int64).reshape(8, batch) - 5  # negative ids: placeholders
    tables = [[3, 4], [7], [1, 2, 5]]
    host = inputs_with_tables(inputs, tables, max_blocks, scratch)
    device = torch.full((16 * batch + batch * max_blocks,), -1, dtype=torch.int32)  # stale entries
    device[: len(host)] = torch.from_numpy(host)
    assert torch.equal(device[: 16 * batch].view(torch.int64).view(8, batch), torch.from_numpy(inputs))
    rows = device[16 * batch:].view(batch, max_blocks)
    assert rows[:, :3].tolist() == [[3, 4, scratch], [7, scratch, scratch], [1, 2, 5], [-1, -1, -1]]
    assert rows[:2, 3:].eq(scratch).all() and rows[2:, 3:].eq(-1).all()  # only up to the last row's blocks
    monkeypatch.setattr(model_runner, "ONE_COPY_TABLE_ENTRIES", 2 * max_blocks + 2)  # the third row's 3 blocks: 15
    assert inputs_with_tables(inputs, tables, max_blocks, scratch) is None


def test_host_ring_rows_are_read_until_taken_again() -> None:
    # Decode graphs write their drawn ids into the ring's rows in turn; a step's ids read after its
    # row was taken by a later step would be that step's: refused.
    ring = _HostRing(8, torch.device("cpu"))
    first = ring.take()
    ring.ids[first, :3] = torch.tensor([5, 6, 7])
    ids = ring.read(first, 3)
    for _ in range(_HostRing.ROWS - 1):
        assert ring.take() != first
    assert ids.tolist() == [5, 6, 7]
    assert ring.take() == first
    with pytest.raises(RuntimeError, match="written again"):
        ids.tolist()


def test_input_ring_rows_are_rewritten_only_once_consumed() -> None:
    # Each decode graph's first kernel (stage_ref here) copies the step's row and notes it consumed;
    # the host rewrites a row only after the graph that read it has.
    ring, dst = _InputRing(6, torch.device("cpu")), torch.zeros(6, dtype=torch.int32)
    stage_ref(ring.rows, ring.counter, ring.consumed, dst, 4)  # a capture's warm-up: no row is its step's
    assert ring.counter.tolist() == [0]
    for step in range(2 * _InputRing.ROWS):
        values = np.arange(step % 5 + 1, dtype=np.int32) + 10 * step
        ring.put(values, 4)
        stage_ref(ring.rows, ring.counter, ring.consumed, dst, 4)
        assert dst[: len(values)].tolist() == values.tolist()
    ring.put(np.empty(0, dtype=np.int32), 4)  # a step whose inputs were copied: the kernel copies nothing
    stage_ref(ring.rows, ring.counter, ring.consumed, dst, 4)
    assert dst[:3].tolist() == [70, 71, 72]
    for _ in range(_InputRing.ROWS):  # steps launched and not yet run: the next takes the first one's row
        ring.put(np.ones(2, dtype=np.int32), 4)
    with pytest.raises(RuntimeError, match="did not consume"):
        ring.put(np.ones(2, dtype=np.int32), 4)
