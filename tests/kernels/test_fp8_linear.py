"""FP8 weight quantization, and the Triton w8a16 FP8 linear kernel against the torch reference on
CPU through Triton's interpreter (float32 and float16; the interpreter gets bfloat16 wrong).
tests/gpu/test_quant_kernels_cuda.py covers the _scaled_mm prefill path."""
from __future__ import annotations

import pytest
import torch

import kernels.split_k as split_k_module
from kernels.activation import silu_mul
from kernels.fp8_linear import (
    FP8, FP8_MAX, fp8_linear, fp8_linear_add_norm, fp8_linear_ref, gemv_config, quantize_fp8, quantize_per_token,
    use_scaled_mm,
)
from kernels.rmsnorm import add_norm_ref, rms_norm_ref
from kernels.split_k import _TILE_COUNTS, gemv_split
from tests.kernels.conftest import nan_poisoned_allocations

# Rows 2 to FEW_ROWS go through the few-row kernels here, as the layers do not send them (split_k.FUSED_ROWS).
pytestmark = pytest.mark.usefixtures("few_row_kernels")

DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def test_quantize_fp8_maps_each_rows_largest_magnitude_to_fp8_max() -> None:
    w = torch.randn(16, 40, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 16)[:, None]
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8 and scale.shape == (16,) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((16,), FP8_MAX))
    torch.testing.assert_close(q.float() * scale[:, None], w, rtol=2**-4, atol=0)  # 3 mantissa bits


def test_quantize_per_token() -> None:
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)) * torch.tensor([1e-3, 1, 10, 300, 1e4])[:, None]
    xq, scale = quantize_per_token(x)
    assert xq.dtype == FP8 and scale.shape == (5, 1)
    assert torch.equal(xq.float().abs().amax(dim=1), torch.full((5,), FP8_MAX))
    torch.testing.assert_close(xq.float() * scale, x, rtol=2**-4, atol=0)


@pytest.mark.parametrize("rows, large", [(1, False), (1, True), (16, False)], ids=["gemv", "gemv-large", "gemm"])
def test_kernel_decodes_every_e4m3_value_exactly(triton_interpreter, monkeypatch, rows, large) -> None:
    """x = one-hot rows picks out weight columns: out must equal the decoded bytes bit for bit
    (subnormals and negatives included; the two NaN bytes are left out)."""
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0 if large else 1 << 30)
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    weight = codes.view(16, 16).view(FP8)  # [N, K]
    x = torch.eye(16)[:rows]
    with nan_poisoned_allocations():
        out = fp8_linear(x, weight, torch.ones(16))
    assert torch.equal(out, weight.float().t()[:rows])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, large", [(1, False), (1, True), (3, False), (33, False)],
                         ids=["gemv", "gemv-large", "few-rows", "gemm"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_linear_matches_reference(triton_interpreter, monkeypatch, dtype, rows, large, with_bias) -> None:
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0 if large else 1 << 30)
    gen = torch.Generator().manual_seed(rows)
    in_features, out_features = 160, 200  # a partial K tile and a partial column tile
    weight, scale = quantize_fp8(torch.randn(out_features, in_features, generator=gen) * in_features**-0.5)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    assert not use_scaled_mm(x, weight)  # on CPU even prefill takes the Triton kernel
    with nan_poisoned_allocations():
        out = fp8_linear(x, weight, scale, bias)
    assert out.dtype == dtype
    torch.testing.assert_close(out, fp8_linear_ref(x, weight, scale, bias), **TOLERANCE[dtype])


def test_fp8_linear_takes_batched_strided_inputs_and_a_per_tensor_scale(triton_interpreter) -> None:
    gen = torch.Generator().manual_seed(2)
    weight, _ = quantize_fp8(torch.randn(48, 64, generator=gen))
    scale = torch.tensor([0.01])
    x = torch.randn(2, 3, 80, generator=gen)[..., 8:72]
    with nan_poisoned_allocations():
        out = fp8_linear(x, weight, scale)
    assert out.shape == (2, 3, 48)
    torch.testing.assert_close(out, fp8_linear_ref(x, weight, scale), **TOLERANCE[torch.float32])


def test_one_row_tiling_by_weight_size() -> None:
    # Llama-3.2-1B: QKV and O in small programs without split-K, gate/up and down in the large tiling.
    assert gemv_config(3072, 2048) == dict(ROWS=4, BLOCK_W=512, num_warps=4, split=False)
    assert gemv_config(2048, 2048)["ROWS"] == 4 and gemv_config(64, 160)["BLOCK_W"] == 64
    assert gemv_config(16384, 2048) == gemv_config(2048, 8192) == dict(ROWS=16, BLOCK_W=64, num_warps=2, split=True)


def test_fp8_one_row_kernel_splits_k_and_leaves_its_counters_at_zero(triton_interpreter, monkeypatch) -> None:
    # 48 rows are 3 row tiles of the large weights' tiling: far under four programs per SM, so K
    # (1,024: 256 words) is split.
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0)
    gen = torch.Generator().manual_seed(6)
    weight, scale = quantize_fp8(torch.randn(48, 1024, generator=gen) * 1024**-0.5)
    x = torch.randn(1, 1024, generator=gen)
    assert gemv_split(3, 256, 64, x.device)[0] == 4
    first = fp8_linear(x, weight, scale)
    assert not _TILE_COUNTS[x.device].any()
    torch.testing.assert_close(fp8_linear(x, weight, scale), first, rtol=0, atol=0)
    torch.testing.assert_close(first, fp8_linear_ref(x, weight, scale), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, large, in_features, out_features",
                         [(1, False, 256, 202), (1, True, 256, 200), (1, True, 1024, 48), (3, True, 256, 200)],
                         ids=["partial-pairs", "large-partial-pairs", "large-split-k", "gemm"])
def test_silu_mul_matches_the_projection_then_the_activation_kernel(triton_interpreter, monkeypatch, dtype, rows,
                                                                    large, in_features, out_features) -> None:
    # One row: SiLU·up in the one-row kernel's epilogue (101 outputs in 2-pair tiles or 100 in
    # 8-pair tiles, the last partial; or 24 outputs in 3 tiles split along K), after rounding gate
    # and up to x's dtype, so bit for bit the projection followed by silu_mul. More rows: the
    # SiLU·up in the few-row GEMM's epilogue.
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0 if large else 1 << 30)
    gen = torch.Generator().manual_seed(in_features + rows)
    weight, scale = quantize_fp8(torch.randn(out_features, in_features, generator=gen) * in_features**-0.5)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    with nan_poisoned_allocations():
        fused = fp8_linear(x, weight, scale, bias, silu_mul=True)
        apart = silu_mul(fp8_linear(x, weight, scale, bias))
    assert fused.shape == (rows, out_features // 2)
    if rows == 1:
        assert torch.equal(fused, apart)
    else:  # the few-row GEMM's epilogue: the interpreter's dot (numpy) may sum its permuted tile in another order
        torch.testing.assert_close(fused, apart, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(fused, fp8_linear_ref(x, weight, scale, bias, silu_mul=True), **TOLERANCE[dtype])
    assert not _TILE_COUNTS.get(x.device, torch.zeros(1)).any()


@pytest.mark.parametrize("dtype", DTYPES)
# 1,024 inputs split both kernels along K as 4,096 did (one step, or two K tiles, a split; fewer splits).
@pytest.mark.parametrize("rows, large, in_features, out_features",
                         [(1, False, 256, 202), (1, True, 256, 200), (1, True, 256, 208), (1, True, 1024, 48),
                          (6, False, 256, 202), (6, False, 1024, 48)],
                         ids=["small", "large-partial-tile", "large", "large-split-k", "few-rows", "few-rows-split-k"])
def test_add_norm_epilogue_and_norm_in_are_the_separate_norm(triton_interpreter, monkeypatch, dtype, rows, large,
                                                            in_features, out_features) -> None:
    # As tests/kernels/test_int4_linear.py's: the add-norm epilogue (one-row kernel, or the few-row
    # GEMM's, one NormScale row a row) is add_norm_ref on its own projection, and the NormScale's
    # factors on the next one's outputs are those factors on x.
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0 if large else 1 << 30)
    gen = torch.Generator().manual_seed(in_features + out_features)
    weight, scale = quantize_fp8(torch.randn(out_features, in_features, generator=gen) * in_features**-0.5)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    residual = torch.randn(rows, out_features, generator=gen).to(dtype)
    norm_w = (torch.rand(out_features, generator=gen) + 0.5).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    with nan_poisoned_allocations():
        u, h, norm = fp8_linear_add_norm(x, weight, scale, bias, residual, norm_w, 1e-5)
    ref_u, ref_h, ref_norm = add_norm_ref(fp8_linear(x, weight, scale, bias), residual, norm_w, 1e-5)
    assert torch.equal(h, ref_h) and torch.equal(u, ref_u)
    assert norm.sumsq.shape == (rows, -(-out_features // (64 if rows > 1 else 16 if large else 4)))
    torch.testing.assert_close(norm.sumsq.sum(-1), ref_norm.sumsq.sum(-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(norm.apply(u), rms_norm_ref(fp8_linear(x, weight, scale, bias), norm_w, 1e-5, residual)[0],
                               **TOLERANCE[dtype])
    w2, s2 = quantize_fp8(torch.randn(96, out_features, generator=gen) * out_features**-0.5)
    with nan_poisoned_allocations():
        out = fp8_linear(u, w2, s2, silu_mul=True, norm_in=norm)
    torch.testing.assert_close(out, fp8_linear_ref(norm.apply(u), w2, s2, silu_mul=True), **TOLERANCE[dtype])
