"""The weight-only linear kernels' shared grid choices: the one-row tiling by weight size and the
splits along K (the kernels themselves: test_int4_linear.py, test_fp8_linear.py)."""
from __future__ import annotations

import torch

from kernels.dispatch import REFERENCE_SM_COUNT, sm_count
from kernels.split_k import FEW_ROWS, few_rows, gemv_split, large_tiling, split_k_for

CPU = torch.device("cpu")


def test_off_cuda_grids_are_sized_for_the_reference_sm_count() -> None:
    assert sm_count(CPU) == REFERENCE_SM_COUNT == 132


def test_one_row_tiling_by_weight_size() -> None:
    # Llama-3.2-1B's [N, K]: QKV and O are small weights, gate/up and down large ones.
    assert not large_tiling(3072, 2048) and not large_tiling(2048, 2048)
    assert large_tiling(16384, 2048) and large_tiling(2048, 8192)


def test_k_is_split_only_where_the_output_tiles_leave_sms_idle() -> None:
    assert gemv_split(4 * 132, 256, 64, CPU) == (1, 256)  # four programs per SM already
    split, per_split = gemv_split(3, 256, 64, CPU)
    assert split == 4 and per_split == 64 and split * per_split >= 256
    split, per_split = split_k_for(3, 1, 16, 512, CPU)
    assert split > 1 and split * per_split >= 16
    assert split_k_for(128, 4 * 132, 32, 2048, CPU) == (1, 32)


def test_the_layers_fuse_epilogues_into_one_row_only() -> None:
    # The few-row kernels measured slower than cuBLAS and the separate kernels at 8 and 16 rows.
    assert few_rows(torch.empty(1, 64)) and few_rows(torch.empty(1, 1, 64))
    assert not few_rows(torch.empty(2, 64)) and not few_rows(torch.empty(FEW_ROWS, 64))
    assert not few_rows(torch.empty(0, 64))
    assert few_rows(torch.empty(FEW_ROWS, 64), FEW_ROWS) and not few_rows(torch.empty(FEW_ROWS + 1, 64), FEW_ROWS)
