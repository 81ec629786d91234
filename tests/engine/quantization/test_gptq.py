"""GPTQ's rounding: a lower output error than rounding to nearest, on the grid it is given."""
from __future__ import annotations

import torch

from engine.quantization.gptq import gptq_round, int4_gptq
from engine.quantization.grid import quantize_weight
from kernels.int4_layout import unpack_awq


def test_gptq_rounding_beats_round_to_nearest_on_the_output() -> None:
    """GPTQ minimizes the output error on its Hessian's inputs: tr((W - Q) H (W - Q)^T), below
    rounding each weight to its nearest level, on correlated inputs; and each column stays on the grid."""
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(64, 64, generator=gen)
    x = torch.randn(512, 64, generator=gen) @ mix  # correlated input features
    w = torch.randn(32, 64, generator=gen)
    step = 0.25

    def nearest(col: torch.Tensor, _k: int = 0) -> torch.Tensor:
        return torch.round(col / step) * step

    def output_error(q: torch.Tensor) -> float:
        return (x @ (w - q).t()).pow(2).mean().item()

    q = gptq_round(w, 2 * x.t() @ x / x.shape[0], nearest, damp=0.01)
    assert torch.equal(q, nearest(q))
    assert output_error(q) < 0.5 * output_error(nearest(w))


def test_int4_gptq_rounds_onto_the_grids_it_exports() -> None:
    """AWQ's GPTQ step: each weight lands on a level of its group's grid (made from the weight before
    rounding), the export writes exactly those levels with that grid, and the output error is
    below rounding to nearest on correlated inputs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=gen) @ torch.randn(64, 64, generator=gen)
    w = torch.randn(16, 64, generator=gen)
    rounded, scale, zero = int4_gptq(w, x, 32)
    packed = quantize_weight(rounded, 32, (scale, zero))
    levels = unpack_awq(packed["qweight"]).t().float()  # [N, K]
    zeros = unpack_awq(packed["qzeros"]).t().float().repeat_interleave(32, dim=1)
    scales = packed["scales"].t().float().repeat_interleave(32, dim=1)
    assert torch.equal((levels - zeros) * scales, rounded)
    nearest = quantize_weight(w, 32)
    nearest_w = (unpack_awq(nearest["qweight"]).t() - unpack_awq(nearest["qzeros"]).t().repeat_interleave(32, dim=1)
                 ) * nearest["scales"].t().float().repeat_interleave(32, dim=1)
    assert (x @ (w - rounded).t()).pow(2).mean() < 0.8 * (x @ (w - nearest_w).t()).pow(2).mean()
