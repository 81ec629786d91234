"""The float one-row GEMV, its few-row version (the rows GEMV) and the few-row tensor-core kernel
(kernels/float_linear.py) against the torch reference on CPU through Triton's interpreter (float32
and float16; the interpreter gets bfloat16 wrong), with their epilogues: SiLU·up, the add-norm and
the next projection's norm factor (RoPE: test_rope_epilogue.py). tests/gpu covers bf16."""
from __future__ import annotations

import pytest
import torch

import kernels.float_linear as float_linear_module
import kernels.split_k as split_k_module
from kernels.activation import silu_mul
from kernels.dispatch import unfolded_norms
from kernels.float_linear import (ROWS_GEMV_MAX, ROWS_GEMV_MOST, PackedWeight, dense, float_linear,
                                 float_linear_add_norm, float_linear_ref, fused_rows, gemv_config, rows_config,
                                 rows_gemv_fits, tma_config, tma_fits)
from kernels.rmsnorm import NormScale, add_norm_ref, rms_norm_ref
from kernels.split_k import _TILE_COUNTS, FEW_ROWS, gemv_split
from tests.kernels.conftest import nan_poisoned_allocations

# Rows 2 to FEW_ROWS go through the few-row kernel here in every dtype (the layers send float32 one row).
pytestmark = pytest.mark.usefixtures("few_row_kernels")

DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def _weights(gen: torch.Generator, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, large", [(1, False), (1, True), (ROWS_GEMV_MOST, False), (3, False),
                                         (FEW_ROWS, False), (FEW_ROWS + 1, False)],
                         ids=["gemv", "gemv-large", "rows-gemv", "few-rows", "few-rows-most", "cublas"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float_linear_matches_reference(triton_interpreter, monkeypatch, dtype, rows, large, with_bias) -> None:
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0 if large else 1 << 30)
    gen = torch.Generator().manual_seed(rows)
    in_features, out_features = 160, 200  # a partial K step and a partial row tile
    weight = _weights(gen, out_features, in_features, dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    assert fused_rows(x, weight) == (rows <= FEW_ROWS)
    with nan_poisoned_allocations():
        out = float_linear(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    torch.testing.assert_close(out, float_linear_ref(x, weight, bias), **TOLERANCE[dtype])


def test_one_row_tiling_by_weight_size() -> None:
    # Llama-3.2-1B in bf16: QKV and O in small programs, 2 KB of a row a step; gate/up (wide) and
    # down (deep) in the large tilings.
    assert gemv_config(3072, 2048, 2) == dict(ROWS=4, BLOCK_K=1024, num_warps=4, AHEAD=1)
    assert gemv_config(64, 160, 4)["BLOCK_K"] == 256 and gemv_config(896, 4864, 2)["BLOCK_K"] == 1024
    assert gemv_config(16384, 2048, 2) == dict(ROWS=8, BLOCK_K=512, num_warps=2, AHEAD=1)
    assert gemv_config(2048, 8192, 2) == dict(ROWS=16, BLOCK_K=128, num_warps=2, AHEAD=2)


def test_one_row_kernel_splits_k_and_leaves_its_counters_at_zero(triton_interpreter, monkeypatch) -> None:
    # 48 rows are 3 row tiles of the large tiling: far under four programs per SM, so K is split
    # (1,024 float32 inputs in 64-input steps).
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0)
    gen = torch.Generator().manual_seed(6)
    weight = _weights(gen, 48, 1024, torch.float32)
    x = torch.randn(1, 1024, generator=gen)
    assert gemv_split(3, 1024, 64, x.device)[0] == 16
    with nan_poisoned_allocations():
        first = float_linear(x, weight)
    assert not _TILE_COUNTS[x.device].any()
    torch.testing.assert_close(float_linear(x, weight), first, rtol=0, atol=0)
    torch.testing.assert_close(first, float_linear_ref(x, weight), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, large, in_features, out_features",
                         [(1, False, 256, 202), (1, True, 256, 200), (1, True, 1024, 48), (5, False, 256, 202),
                          (5, False, 1024, 48), (2, False, 256, 202)],
                         ids=["partial-pairs", "large-partial-pairs", "large-split-k", "few-rows", "few-rows-split-k",
                              "rows-gemv"])
def test_silu_mul_matches_the_projection_then_the_activation_kernel(triton_interpreter, monkeypatch, dtype, rows,
                                                                    large, in_features, out_features) -> None:
    # SiLU·up in the epilogue rounds gate and up to x's dtype first: bit for bit the projection
    # followed by silu_mul.
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0 if large else 1 << 30)
    gen = torch.Generator().manual_seed(in_features)
    weight = _weights(gen, out_features, in_features, dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    with nan_poisoned_allocations():
        fused = float_linear(x, weight, bias, silu_mul=True)
        apart = silu_mul(float_linear(x, weight, bias))
    assert fused.shape == (rows, out_features // 2)
    if rows == 1:
        assert torch.equal(fused, apart)
    else:  # the interpreter's dot (numpy) may sum a permuted weight tile in another order (then fp16 may round
        # one ulp apart); tests/gpu: bit for bit
        ulp = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=2e-5)
        torch.testing.assert_close(fused, apart, **ulp)
    torch.testing.assert_close(fused, float_linear_ref(x, weight, bias, silu_mul=True), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_in", [False, True])
@pytest.mark.parametrize("in_features, out_features, early_steps", [(296, 328, 2), (1320, 1330, 1)],
                         ids=["two-early-steps", "one-early-step"])
def test_tma_gemv_silu_mul_matches_the_reference(triton_interpreter, monkeypatch, dtype, norm_in, in_features,
                                                 out_features, early_steps) -> None:
    # A wide gate/up weight of the large tiling streams through TMA: the last program's pairs partly
    # past the edge, a partial last step (loaded as zeros), two steps read before the wait on a short
    # row and one on a deep row, with the next projection's norm factor or without.
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0)
    gen = torch.Generator().manual_seed(300)
    weight = _weights(gen, out_features, in_features, dtype)
    x = torch.randn(1, in_features, generator=gen).to(dtype)
    norm = NormScale(torch.rand(1, 5, generator=gen) * in_features, 1e-5) if norm_in else None
    cfg = tma_config(weight.element_size(), in_features)
    assert tma_fits(x, weight) and (out_features // 2) % cfg["PAIRS"] and in_features % cfg["BLOCK_K"]
    assert cfg["EARLY_STEPS"] == early_steps
    with nan_poisoned_allocations():
        out = float_linear(x, weight, silu_mul=True, norm_in=norm)
    reference = float_linear_ref(x if norm is None else norm.apply(x), weight, silu_mul=True)
    torch.testing.assert_close(out, reference, **TOLERANCE[dtype])


def test_tma_takes_wide_large_weights_only(triton_interpreter, monkeypatch) -> None:
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 64 * 64)
    x = torch.zeros(1, 64, dtype=torch.float16)
    assert tma_fits(x, torch.zeros(128, 64, dtype=torch.float16))
    assert not tma_fits(x, torch.zeros(32, 64, dtype=torch.float16))  # small
    assert not tma_fits(torch.zeros(1, 128), torch.zeros(64, 128))  # deep (down)
    assert not tma_fits(torch.zeros(1, 63, dtype=torch.float16), torch.zeros(128, 63, dtype=torch.float16))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not tma_fits(x, torch.zeros(128, 64, dtype=torch.float16))  # a CPU tensor, no interpreter


@pytest.mark.parametrize("dtype", DTYPES)
# large-split-k: 4,096 inputs give float32 two steps a split (AHEAD's second step read). few-rows-split-k:
# 2,048 split the few-row kernel as 4,096 did (the same K tiles a split, fewer splits); at 1,024 fp16
# would take the rows GEMV.
@pytest.mark.parametrize("rows, large, in_features, out_features",
                         [(1, False, 256, 202), (1, True, 256, 208), (1, True, 4096, 48), (6, False, 256, 202),
                          (6, False, 2048, 48), (2, False, 256, 202)],
                         ids=["small", "large", "large-split-k", "few-rows", "few-rows-split-k", "rows-gemv"])
def test_add_norm_epilogue_and_norm_in_are_the_separate_norm(triton_interpreter, monkeypatch, dtype, rows, large,
                                                            in_features, out_features) -> None:
    # The add-norm epilogue is add_norm_ref on the kernel's own projection, one NormScale row per
    # row; the NormScale's factors on the next projection's outputs are those factors applied to
    # its input.
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0 if large else 1 << 30)
    gen = torch.Generator().manual_seed(in_features + out_features)
    weight = _weights(gen, out_features, in_features, dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    residual = torch.randn(rows, out_features, generator=gen).to(dtype)
    norm_w = (torch.rand(out_features, generator=gen) + 0.5).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    with nan_poisoned_allocations():
        u, h, norm = float_linear_add_norm(x, weight, bias, residual, norm_w, 1e-5)
    y = float_linear(x, weight, bias)
    ref_u, ref_h, ref_norm = add_norm_ref(y, residual, norm_w, 1e-5)
    assert torch.equal(h, ref_h) and torch.equal(u, ref_u)
    # one row, or a few over a small unsplit weight: the GEMV's tilings (large: out_features <
    # in_features, the deep one); else the few-row kernel's
    gemv = rows == 1 or rows_gemv_fits(rows, out_features, in_features, 4, x.device)
    tile = gemv_config(out_features, in_features, 4)["ROWS"] if gemv else rows_config(4)["BLOCK_N"]
    assert norm.sumsq.shape == (rows, -(-out_features // tile))
    torch.testing.assert_close(norm.sumsq.sum(-1), ref_norm.sumsq.sum(-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(norm.apply(u), rms_norm_ref(y, norm_w, 1e-5, residual)[0], **TOLERANCE[dtype])
    w2 = _weights(gen, 96, out_features, dtype)
    with nan_poisoned_allocations():
        out = float_linear(u, w2, silu_mul=True, norm_in=norm)
    torch.testing.assert_close(out, float_linear_ref(norm.apply(u), w2, silu_mul=True), **TOLERANCE[dtype])


@pytest.mark.parametrize("rows, split, dtype", [(5, False, torch.float16), (8, False, torch.float32),
                                                (8, True, torch.float32)],
                         ids=["5-rows-fp16", "8-rows", "8-rows-split-k"])
def test_rows_gemv_at_up_to_its_most_rows(triton_interpreter, monkeypatch, dtype, rows, split) -> None:
    # Every small weight through the rows GEMV up to ROWS_GEMV_MAX rows (8 rows' sums a step), whole
    # or split along K as the one-row GEMV splits it: the plain projection, SiLU·up and the add-norm.
    monkeypatch.setattr(float_linear_module, "ROWS_GEMV_MOST", ROWS_GEMV_MAX)
    monkeypatch.setattr(float_linear_module, "ROWS_GEMV_SPLIT", split)
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 1 << 30)
    in_features, out_features = (1024, 48) if split else (160, 42)  # 12 row tiles split in 2; partial tiles and step
    gen = torch.Generator().manual_seed(rows)
    weight = _weights(gen, out_features, in_features, dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    assert rows_gemv_fits(rows, out_features, in_features, weight.element_size(), x.device)
    cfg = gemv_config(out_features, in_features, weight.element_size())
    assert (gemv_split(-(-out_features // cfg["ROWS"]), in_features, cfg["BLOCK_K"], x.device)[0] > 1) == split
    with nan_poisoned_allocations():
        out = float_linear(x, weight, bias)
        fused = float_linear(x, weight, bias, silu_mul=True)
    torch.testing.assert_close(out, float_linear_ref(x, weight, bias), **TOLERANCE[dtype])
    assert torch.equal(fused, silu_mul(out))  # the same sums, rounded to x's dtype before SiLU·up
    residual = torch.randn(rows, out_features, generator=gen).to(dtype)
    norm_w = (torch.rand(out_features, generator=gen) + 0.5).to(dtype)
    with nan_poisoned_allocations():
        u, h, norm = float_linear_add_norm(x, weight, bias, residual, norm_w, 1e-5)
    ref_u, ref_h, _ = add_norm_ref(out, residual, norm_w, 1e-5)
    assert torch.equal(h, ref_h) and torch.equal(u, ref_u)
    assert not split or not _TILE_COUNTS[x.device].any()


def test_rows_gemv_takes_few_rows_where_it_measured_faster() -> None:
    # bf16 on the reference SM count (an H100's or H200's 132): any small unsplit weight at 2 rows; up
    # to 6 rows within 10 Mi products (the 1B QKV stays on the tensor cores); 7-8 rows only over
    # weights that fill their K steps (the 0.5B's K of 896 in 1,024-input steps, not the 135M's 576).
    cpu = torch.device("cpu")
    weights = {"1b-qkv": (3072, 2048), "1b-o": (2048, 2048), "0.5b-qkv": (1152, 896), "135m-gate-up": (3072, 576),
               "135m-o": (576, 576), "1b-gate-up": (16384, 2048)}
    fits = {name: [rows for rows in range(2, 10) if rows_gemv_fits(rows, n, k, 2, cpu)]
            for name, (n, k) in weights.items()}
    assert fits == {"1b-qkv": [2], "1b-o": [], "0.5b-qkv": [2, 3, 4, 5, 6, 7, 8], "135m-gate-up": [2, 3, 4, 5],
                    "135m-o": [2, 3, 4, 5, 6], "1b-gate-up": []}


def test_add_norm_is_the_norm_kernel_where_norms_do_not_fold(triton_interpreter) -> None:
    # More rows than the few-row kernel takes, or inside unfolded_norms(): the projection, then the
    # norm (exactly normalized, no NormScale).
    gen = torch.Generator().manual_seed(3)
    weight = _weights(gen, 64, 32, torch.float32)
    norm_w = torch.rand(64, generator=gen) + 0.5
    for rows, context in ((FEW_ROWS + 1, None), (1, unfolded_norms), (3, unfolded_norms)):
        x = torch.randn(rows, 32, generator=gen)
        residual = torch.randn(rows, 64, generator=gen)
        if context is None:
            normed, h, norm = float_linear_add_norm(x, weight, None, residual, norm_w, 1e-5)
        else:
            with context():
                normed, h, norm = float_linear_add_norm(x, weight, None, residual, norm_w, 1e-5)
        ref, ref_h = rms_norm_ref(float_linear(x, weight), norm_w, 1e-5, residual)
        assert norm is None and torch.equal(h, ref_h)
        torch.testing.assert_close(normed, ref, **TOLERANCE[torch.float32])



@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL packs the weights")
@pytest.mark.parametrize("rows", [4, 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_weight_is_the_plain_projection(rows, with_bias) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = _weights(gen, 200, 160, torch.float32)
    bias = torch.randn(200, generator=gen) if with_bias else None
    packed = PackedWeight.of(weight, 5)
    x = torch.randn(rows, 160, generator=gen)
    assert packed is not None and packed.takes(x) and not fused_rows(x, weight)
    out = float_linear(x, weight, bias, packed=packed)
    assert out.shape == (rows, 200)
    torch.testing.assert_close(out, float_linear_ref(x, weight, bias), **TOLERANCE[torch.float32])
    assert torch.equal(dense(x, weight, bias, packed), packed(x, bias))


def test_weights_are_packed_only_where_it_helps() -> None:
    weight = torch.randn(8, 16)
    assert PackedWeight.of(weight, PackedWeight.MIN_ROWS - 1) is None  # MKL's small-row path is fast already
    assert PackedWeight.of(weight.half(), 5) is None
    packed = PackedWeight.of(weight, 5)
    if packed is not None:  # where MKL is
        assert not packed.takes(torch.randn(3, 16)) and not packed.takes(torch.randn(6, 16))
        assert packed.takes(torch.randn(1, 4, 16))
