"""A decode graph's first kernel (kernels/staging.py): the step's inputs from a ring of host rows,
against the torch reference, on CPU through Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from kernels.staging import HEAD, stage, stage_ref

KEY = 8  # the graph's batch


def _ring(lengths: list[int], width: int, first_step: int, key: int = KEY) -> torch.Tensor:
    """Rows as the host writes them for steps first_step, first_step + 1, ... (row = step % rows)."""
    ring = torch.zeros(len(lengths), HEAD + width, dtype=torch.int32)
    for i, n in enumerate(lengths):
        step = first_step + i
        row = step % len(lengths)
        ring[row, :HEAD] = torch.tensor([step, key, n])
        ring[row, HEAD: HEAD + n] = torch.arange(n, dtype=torch.int32) * 7 + 1000 * step - 5  # negatives too
    return ring


@pytest.fixture(params=["triton", "reference"])
def run(request):
    if request.param == "triton":
        request.getfixturevalue("triton_interpreter")
        return stage
    return stage_ref


def test_stage_copies_each_steps_row_in_turn(run) -> None:
    # Rows of no values, a few, up to the first block's end and past it (the kernel's loop).
    lengths = [0, 5, 1024 - HEAD, 2500]
    ring = _ring(lengths, 2600, first_step=2)
    counter = torch.tensor([2], dtype=torch.int64)
    consumed = torch.full((4,), -1, dtype=torch.int64)
    for i, n in enumerate(lengths):
        step = 2 + i
        row = step % 4
        dst = torch.full((2600,), -99, dtype=torch.int32)
        run(ring, counter, consumed, dst, KEY)
        assert torch.equal(dst[:n], ring[row, HEAD: HEAD + n]), (step, n)
        assert dst[n:].eq(-99).all()  # nothing past the row's values
        assert consumed[row] == step and counter.tolist() == [step + 1]


@pytest.mark.parametrize("case", ["another step's row", "another graph's row"])
def test_a_row_not_written_for_this_step_and_graph_is_left(run, case: str) -> None:
    # A graph replayed with no row written for it (a benchmark replaying it alone) runs on what its
    # buffer holds and does not count: the row stays for the replay it was written for.
    ring = _ring([3, 3], 8, first_step=4)  # steps 4 and 5, for the graph of KEY
    counter = torch.tensor([5 if case == "another step's row" else 4])
    if case == "another step's row":
        ring[1, 0] = 3  # row 1 still holds step 3's inputs: step 5's are not written yet
    key = KEY if case == "another step's row" else KEY * 2
    consumed, dst = torch.full((2,), -1), torch.full((8,), -99, dtype=torch.int32)
    run(ring, counter, consumed, dst, key)
    assert dst.eq(-99).all() and consumed.tolist() == [-1, -1] and counter.tolist() == [counter.item()]
    if case == "another graph's row":
        run(ring, counter, consumed, dst, KEY)  # the graph it was written for takes it
        assert dst[:3].tolist() == [3995, 4002, 4009] and counter.tolist() == [5]


def test_stage_reads_a_row_narrower_than_its_block(triton_interpreter) -> None:
    ring = _ring([1, 1], 1, first_step=0)  # HEAD + 1 entries a row, under the kernel's block: masked
    counter, consumed, dst = torch.tensor([1]), torch.full((2,), -1), torch.zeros(2, dtype=torch.int32)
    stage(ring, counter, consumed, dst, KEY)
    assert dst.tolist() == [995, 0] and consumed.tolist() == [-1, 1]
