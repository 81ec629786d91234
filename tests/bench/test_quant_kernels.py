"""bench/quant_kernels.py's INT4 tilings ("ROWSxWORDSxWARPS", then "rN" a register cap and "sN" a
K split aiming at N programs an SM) put on the GEMV for a while, and taken off after."""
from __future__ import annotations

import pytest
import torch

import bench.quant_kernels as quant_kernels
from kernels import int4_linear, split_k


def test_a_tiling_sets_rows_words_warps_and_its_register_cap() -> None:
    with quant_kernels.one_row_tiling("8x128x2r168"):
        assert int4_linear.gemv_config(16384, 2048, 128) == dict(ROWS=8, BLOCK_W=128, num_warps=2, num_stages=1,
                                                                 maxnreg=168)
        assert int4_linear.gemv_config(16384, 2048, 1024)["BLOCK_W"] == 128  # at least a group a step
    assert "maxnreg" not in int4_linear.gemv_config(16384, 2048, 128)


def test_a_split_target_spreads_few_row_tiles_over_more_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(split_k, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    with quant_kernels.one_row_tiling("16x32x1s16"):
        assert int4_linear.gemv_split(128, 1024, 32, cpu) == (16, 64)  # 128 tiles x 16 splits: 2,048 programs
        assert int4_linear.gemv_split(1056, 256, 32, cpu) == (1, 256)  # enough tiles: not split
    assert int4_linear.gemv_split is quant_kernels.split_k_module.gemv_split
