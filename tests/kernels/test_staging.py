"""A decode graph's first kernel (kernels/staging.py): the step's inputs from a ring of host rows,
against the torch reference, on CPU through Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from kernels.staging import stage, stage_ref


def _ring(lengths: list[int], width: int) -> torch.Tensor:
    ring = torch.zeros(len(lengths), width, dtype=torch.int32)
    for row, n in enumerate(lengths):
        ring[row, 0] = n
        ring[row, 1: 1 + n] = torch.arange(n, dtype=torch.int32) * 7 + 1000 * row - 5  # negatives too
    return ring


@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_stage_copies_each_steps_row_in_turn(request, kernel: str) -> None:
    if kernel == "triton":
        request.getfixturevalue("triton_interpreter")
    run = stage if kernel == "triton" else stage_ref
    # Rows of no entries, a few, one short of the first block and past it (the kernel's loop).
    lengths = [0, 5, 1023, 2500]
    ring = _ring(lengths, 2600)
    counter = torch.tensor([2], dtype=torch.int64)  # the graphs count on from where they were
    consumed = torch.full((4,), -1, dtype=torch.int64)
    for step in range(2, 8):
        row = step % 4
        dst = torch.full((2600,), -99, dtype=torch.int32)
        run(ring, counter, consumed, dst)
        n = lengths[row]
        assert torch.equal(dst[:n], ring[row, 1: 1 + n]), (step, n)
        assert dst[n:].eq(-99).all()  # nothing past the row's entries
        assert consumed[row] == step and counter.tolist() == [step + 1]
    assert consumed.tolist() == [4, 5, 6, 7]


def test_stage_reads_a_row_narrower_than_its_block(triton_interpreter) -> None:
    ring = _ring([3, 2], 4)  # width 4 < the kernel's block: its first read is masked at the row's end
    counter, consumed, dst = torch.tensor([1]), torch.full((2,), -1), torch.zeros(4, dtype=torch.int32)
    stage(ring, counter, consumed, dst)
    assert dst.tolist() == [995, 1002, 0, 0] and consumed.tolist() == [-1, 1]
