"""The Triton INT4 linear kernels against the torch reference on CPU through Triton's interpreter
(float32 and float16; the interpreter gets bfloat16 wrong)."""
from __future__ import annotations

import pytest
import torch

import kernels.split_k as split_k_module
from kernels.activation import silu_mul
from kernels.int4_layout import dequantize_int4, pack_int4
from kernels.int4_linear import (TILE_GEMM_MAX_ROWS, dequantize_int4_triton, int4_linear, int4_linear_add_norm,
                                 int4_linear_ref)
from kernels.rmsnorm import add_norm_ref, rms_norm_ref
from kernels.split_k import _TILE_COUNTS, FEW_ROWS, split_k_for
from tests.kernels.conftest import nan_poisoned_allocations

# Rows 2 to FEW_ROWS go through the few-row kernels here, as the layers do not send them (split_k.FUSED_ROWS).
pytestmark = pytest.mark.usefixtures("few_row_kernels")

DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}
# The one-row kernel (GEMV) sums 1 + q * 2**-4 (not q) per weight in float32: about
# 2**-20 of sum |x| lost (~1e-5 on these O(1) outputs; bfloat16 rounds them to 2**-9).
GEMV_TOLERANCE = {torch.float32: dict(atol=5e-5, rtol=1e-5), torch.float16: TOLERANCE[torch.float16]}


def int4_weight(in_features: int, out_features: int, group_size: int,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random runtime-layout (weight, zeros, fp16 scales) whose layer maps O(1) inputs to O(1) outputs."""
    q = torch.randint(0, 16, (out_features, in_features), generator=gen)
    zeros = torch.randint(0, 16, (out_features, in_features // group_size), generator=gen).half()
    scales = (torch.rand(out_features, in_features // group_size, generator=gen) + 0.5) * 0.3 * in_features**-0.5
    return pack_int4(q), zeros, scales.half()


# ---- the Triton kernels (interpreter) -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 17, 40], ids=["gemv", "few-rows", "gemm-17", "gemm-40"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_linear_matches_reference(triton_interpreter, dtype, group_size, rows, with_bias) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + group_size)
    in_features, out_features = 256, 200  # 200: the last feature tile is partial
    weight, zeros, scales = int4_weight(in_features, out_features, group_size, gen)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    with nan_poisoned_allocations():
        out = int4_linear(x, weight, zeros, scales, group_size, bias)
    # float32: against exact dequantization (the reference rounds W to the scales' float16).
    ref = int4_linear_ref(x, weight, zeros, scales.to(torch.promote_types(dtype, scales.dtype)), group_size, bias)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **(GEMV_TOLERANCE if rows == 1 else TOLERANCE)[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [16, 64, 128])
@pytest.mark.parametrize("in_features, out_features", [(256, 200), (576, 72), (4096, 40)],
                         ids=["partial-rows", "partial-step", "split-k"])
@pytest.mark.parametrize("large", [False, True], ids=["small-tiling", "large-tiling"])
def test_gemv_matches_reference(triton_interpreter, monkeypatch, dtype, group_size, in_features,
                                       out_features, large) -> None:
    # The one-row kernel at either tiling (the large weights' forced at test sizes). 576 = 4.5 steps
    # of 128 features (2.25 of the small tiling's 256 words); 4,096 features against a few row tiles
    # are split along K, summed by the last split.
    if in_features % group_size:
        pytest.skip("the group size does not tile K")
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0 if large else 1 << 62)
    gen = torch.Generator().manual_seed(in_features + group_size)
    weight, zeros, scales = int4_weight(in_features, out_features, group_size, gen)
    x = torch.randn(1, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    with nan_poisoned_allocations():
        out = int4_linear(x, weight, zeros, scales, group_size, bias)
    ref = int4_linear_ref(x, weight, zeros, scales.to(torch.promote_types(dtype, scales.dtype)), group_size, bias)
    torch.testing.assert_close(out, ref, **GEMV_TOLERANCE[dtype])
    assert not _TILE_COUNTS.get(x.device, torch.zeros(1)).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features, out_features", [(256, 200), (4096, 40)], ids=["partial-pairs", "split-k"])
def test_gemv_ends_in_silu_mul_as_the_two_kernels_do(triton_interpreter, monkeypatch, dtype, in_features,
                                                             out_features) -> None:
    # A merged gate/up weight [2 * 100, K]: 100 outputs, the last 8-pair tile partial; at 4,096
    # features the 20 outputs' 3 tiles are split along K. The fused epilogue rounds gate and up to
    # x's dtype first, so it matches the stored projection followed by silu_mul bit for bit.
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0)
    gen = torch.Generator().manual_seed(in_features + out_features)
    weight, zeros, scales = int4_weight(in_features, out_features, 64, gen)
    x = torch.randn(1, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    with nan_poisoned_allocations():
        fused = int4_linear(x, weight, zeros, scales, 64, bias, silu_mul=True)
        apart = silu_mul(int4_linear(x, weight, zeros, scales, 64, bias))
    assert fused.shape == (1, out_features // 2) and torch.equal(fused, apart)
    exact_scales = scales.to(torch.promote_types(dtype, scales.dtype))
    ref = int4_linear_ref(x, weight, zeros, exact_scales, 64, bias, silu_mul=True)
    torch.testing.assert_close(fused, ref, **GEMV_TOLERANCE[dtype])
    assert not _TILE_COUNTS.get(x.device, torch.zeros(1)).any()


@pytest.mark.parametrize("rows", [1, 5, FEW_ROWS + 1])
def test_silu_mul_on_the_other_paths_is_the_activation_kernel(triton_interpreter, rows) -> None:
    # One row: the GEMV's small tiling; up to FEW_ROWS: the few-row GEMM's epilogue; more: the activation kernel.
    gen = torch.Generator().manual_seed(rows)
    weight, zeros, scales = int4_weight(256, 64, 32, gen)
    x = torch.randn(rows, 256, generator=gen)
    out = int4_linear(x, weight, zeros, scales, 32, silu_mul=True)
    apart = silu_mul(int4_linear(x, weight, zeros, scales, 32))
    if 1 < rows <= FEW_ROWS:  # the interpreter's dot (numpy) may sum the epilogue's permuted tile in another order
        torch.testing.assert_close(out, apart, rtol=2e-6, atol=2e-6)
    else:
        assert torch.equal(out, apart)


def test_split_k_leaves_its_tile_counters_at_zero(triton_interpreter) -> None:
    # The last split of each tile sums the partials and zeroes the tile's counter: the next call
    # (or the next replay of a CUDA graph) counts from zero again and gives the same output.
    gen = torch.Generator().manual_seed(7)
    weight, zeros, scales = int4_weight(512, 64, 32, gen)
    x = torch.randn(3, 512, generator=gen)
    assert split_k_for(3, 1, 16, 512, x.device)[0] > 1
    first = int4_linear(x, weight, zeros, scales, 32)
    assert not _TILE_COUNTS[x.device].any()
    torch.testing.assert_close(int4_linear(x, weight, zeros, scales, 32), first, rtol=0, atol=0)
    torch.testing.assert_close(first, int4_linear_ref(x, weight, zeros, scales.float(), 32), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40, 70])
def test_int4_linear_masks_a_partial_k_tile(triton_interpreter, dtype, rows) -> None:
    # SmolLM2's hidden size with groups of 64: 4.5 K tiles of 128 for the GEMM.
    gen = torch.Generator().manual_seed(rows)
    weight, zeros, scales = int4_weight(576, 72, 64, gen)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    bias = torch.randn(72, generator=gen).to(dtype)
    with nan_poisoned_allocations():
        out = int4_linear(x, weight, zeros, scales, 64, bias)
    ref = int4_linear_ref(x, weight, zeros, scales.to(torch.promote_types(dtype, scales.dtype)), 64, bias)
    torch.testing.assert_close(out, ref, **(GEMV_TOLERANCE if rows == 1 else TOLERANCE)[dtype])


@pytest.mark.parametrize("rows", [1, 4])
def test_int4_linear_takes_batched_and_strided_inputs(triton_interpreter, rows) -> None:
    gen = torch.Generator().manual_seed(3)
    weight, zeros, scales = int4_weight(64, 64, 32, gen)  # K = 64: half a K tile of the GEMM
    wide = torch.randn(2, rows, 96, generator=gen)
    x = wide[..., 16:80]  # [2, rows, 64], rows 96 apart
    with nan_poisoned_allocations():
        out = int4_linear(x, weight, zeros, scales, 32)
    assert out.shape == (2, rows, 64)
    torch.testing.assert_close(out, int4_linear_ref(x, weight, zeros, scales.float(), 32), **TOLERANCE[torch.float32])


def test_int4_linear_rejects_a_group_size_that_does_not_tile_k(triton_interpreter) -> None:
    weight, zeros, scales = int4_weight(96, 8, 32, torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="group size"):
        int4_linear(torch.randn(1, 96), weight, zeros[:, :2], scales[:, :2], 48)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("in_features", "out_features", "group_size"), [(576, 40, 64), (256, 33, 32)])
def test_prefill_dequantizes_with_triton_then_multiplies(triton_interpreter, dtype, in_features, out_features,
                                                         group_size) -> None:
    """Past TILE_GEMM_MAX_ROWS rows the weight is dequantized by a Triton kernel (ragged tiles on both axes)."""
    gen = torch.Generator().manual_seed(4)
    weight, zeros, scales = int4_weight(in_features, out_features, group_size, gen)
    exact = scales.to(torch.promote_types(dtype, scales.dtype))  # float32: no rounding of W to float16
    torch.testing.assert_close(dequantize_int4_triton(weight, zeros, scales, group_size, dtype),
                               dequantize_int4(weight, zeros, exact, group_size).to(dtype), rtol=0, atol=0)
    x = torch.randn(TILE_GEMM_MAX_ROWS + 3, in_features, generator=gen).to(dtype)
    torch.testing.assert_close(int4_linear(x, weight, zeros, scales, group_size),
                               int4_linear_ref(x, weight, zeros, exact, group_size), **TOLERANCE[dtype])


# ---- the norm folded into the one-row kernels (batch-1 decode) ---------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
# 1,024 inputs split both kernels along K as 4,096 did (one step, or two K tiles, a split; fewer splits).
@pytest.mark.parametrize("rows, large, in_features, out_features",
                         [(1, False, 256, 80), (1, True, 256, 200), (1, True, 256, 208), (1, True, 1024, 48),
                          (6, False, 256, 80), (6, False, 1024, 48)],
                         ids=["small-tiling", "large-partial-tile", "large", "large-split-k", "few-rows",
                              "few-rows-split-k"])
def test_add_norm_epilogue_and_norm_in_are_the_separate_norm(triton_interpreter, monkeypatch, dtype, rows, large,
                                                            in_features, out_features) -> None:
    # o_proj / down_proj: y = x W^T + b, then h = y + residual (the new residual) and the norm of h,
    # left as h * weight and a NormScale; the next projection applies its factor to its outputs.
    # Against add_norm_ref (same roundings: exact but for the sum of squares' order) and against
    # rms_norm followed by the projection (within the rounding of h * weight).
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0 if large else 1 << 30)
    gen = torch.Generator().manual_seed(in_features + out_features)
    weight, zeros, scales = int4_weight(in_features, out_features, 64, gen)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    residual = torch.randn(rows, out_features, generator=gen).to(dtype)
    norm_w = (torch.rand(out_features, generator=gen) + 0.5).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    with nan_poisoned_allocations():
        u, h, scale = int4_linear_add_norm(x, weight, zeros, scales, 64, bias, residual, norm_w, 1e-5)
    exact_scales = scales.to(torch.promote_types(dtype, scales.dtype))
    y = int4_linear(x, weight, zeros, scales, 64, bias)  # the kernel's own projection: the sums below are exact
    ref_u, ref_h, ref_scale = add_norm_ref(y, residual, norm_w, 1e-5)
    assert torch.equal(h, ref_h) and torch.equal(u, ref_u)
    tiles = -(-out_features // (64 if rows > 1 else 16 if large else 8))
    assert scale.sumsq.shape == (rows, tiles) and scale.eps == 1e-5
    torch.testing.assert_close(scale.sumsq.sum(-1), ref_scale.sumsq.sum(-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(h, int4_linear_ref(x, weight, zeros, exact_scales, 64, bias) + residual,
                               **GEMV_TOLERANCE[dtype])
    normed, new_residual = rms_norm_ref(y, norm_w, 1e-5, residual)
    assert torch.equal(new_residual, h)
    torch.testing.assert_close(scale.apply(u), normed, **TOLERANCE[dtype])
    if out_features % 16:
        return
    # The next projection [out_features -> 96] fed u and the NormScale, against it fed u scaled first.
    w2, z2, s2 = int4_weight(out_features, 96, 16, gen)
    bias = torch.randn(96, generator=gen).to(dtype)
    with nan_poisoned_allocations():
        out = int4_linear(u, w2, z2, s2, 16, bias, norm_in=scale)
    ref = int4_linear_ref(scale.apply(u), w2, z2, s2.to(torch.promote_types(dtype, s2.dtype)), 16, bias)
    torch.testing.assert_close(out, ref, **GEMV_TOLERANCE[dtype])


def test_norm_in_and_add_norm_off_the_kernels_are_the_reference() -> None:
    # Off the kernels nothing folds: add_norm is the projection and the norm, exactly normalized; a
    # NormScale handed in anyway scales x before the reference projection.
    gen = torch.Generator().manual_seed(11)
    weight, zeros, scales = int4_weight(128, 64, 32, gen)
    x, residual, norm_w = torch.randn(1, 128, generator=gen), torch.randn(1, 64, generator=gen), torch.rand(64) + 0.5
    normed, h, scale = int4_linear_add_norm(x, weight, zeros, scales, 32, None, residual, norm_w, 1e-6)
    ref, new_residual = rms_norm_ref(int4_linear_ref(x, weight, zeros, scales, 32), norm_w, 1e-6, residual)
    assert scale is None and torch.equal(h, new_residual) and torch.equal(normed, ref)
    u, _, norm = add_norm_ref(int4_linear_ref(x, weight, zeros, scales, 32), residual, norm_w, 1e-6)
    w2, z2, s2 = int4_weight(64, 32, 32, gen)
    torch.testing.assert_close(int4_linear(u, w2, z2, s2, 32, norm_in=norm),
                               int4_linear_ref(norm.apply(u), w2, z2, s2, 32), rtol=1e-4, atol=1e-5)
