"""RoPE and the KV write in the epilogue of each format's one-row QKV kernel (kernels/rope.py's
store_rope_kv, in kernels/float_linear.py, fp8_linear.py and int4_linear.py), against the
projection followed by rope_store_kv, on CPU through Triton's interpreter (float32 and float16)."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kernels.split_k as split_k_module
from kernels.dispatch import reference_kernels
from kernels.float_linear import float_linear, float_linear_rope_kv
from kernels.fp8_linear import fp8_linear, fp8_linear_rope_kv, quantize_fp8
from kernels.int4_linear import int4_linear, int4_linear_rope_kv
from kernels.rope import RopeKV, rope_cos_sin, rope_inv_freq, rope_store_qkv
from tests.kernels.conftest import nan_poisoned_allocations
from tests.kernels.test_int4_linear import int4_weight

# Rows 2 to FEW_ROWS go through the few-row kernels here, as the layers do not send them (split_k.FUSED_ROWS).
pytestmark = pytest.mark.usefixtures("few_row_kernels")

DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}
# A few-row kernel against the same projection apart: a last-bit difference at most (see below).
FEW_ROWS_TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.float16: dict(atol=1e-3, rtol=1e-3)}
Project = Callable[[torch.Tensor], torch.Tensor]
Fused = Callable[[torch.Tensor, RopeKV], torch.Tensor]


def _format(fmt: str, out_features: int, in_features: int, dtype: torch.dtype, bias: torch.Tensor | None,
            gen: torch.Generator) -> tuple[Project, Fused]:
    """The format's projection (x -> x W^T + bias) and its one-row QKV kernel with the RoPE epilogue."""
    if fmt == "float":
        w = (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).to(dtype)
        return lambda x: float_linear(x, w, bias), lambda x, rope: float_linear_rope_kv(x, w, bias, None, rope)
    if fmt == "fp8":
        w, scale = quantize_fp8(torch.randn(out_features, in_features, generator=gen) * in_features**-0.5)
        return lambda x: fp8_linear(x, w, scale, bias), lambda x, rope: fp8_linear_rope_kv(x, w, scale, bias, None,
                                                                                            rope)
    w4 = int4_weight(in_features, out_features, 32, gen)
    return (lambda x: int4_linear(x, *w4, 32, bias),
            lambda x, rope: int4_linear_rope_kv(x, *w4, 32, bias, None, rope))


# The float format with and without a bias; the quantized ones with one (their epilogue is shared).
CASES = [(f, t, b) for t in (1, 2, 3) for f in ("float", "fp8", "int4")
         for b in ((False, True) if f == "float" else (True,))]
SHAPES = {"small": (False, 4, 2, 16, 64), "large": (True, 4, 2, 16, 64), "large-split-k": (True, 2, 1, 32, 512),
          "odd-heads": (False, 3, 1, 8, 64)}
# 512 inputs split every kernel along K, one step or K tile a split as at 1,024, but int4's one-row
# GEMV, which reads 512 inputs a step: it takes 1,024.
SPLIT_K_INPUTS = {("int4", 1): 1024}


def _shape(shape: str, fmt: str, tokens: int) -> tuple:
    large, heads, kv_heads, head_dim, in_features = SHAPES[shape]
    if shape == "large-split-k":
        in_features = SPLIT_K_INPUTS.get((fmt, tokens), in_features)
    return large, heads, kv_heads, head_dim, in_features


# Split along K, a case takes a second or more in the interpreter: one and two rows with a bias
# there (the rows and the bias meet the epilogue at the other shapes too).
PARAMS = [pytest.param(*_shape(shape, f, t), f, t, b,
                       id=f"{shape}-{f}{f'-{t}-rows' if t > 1 else ''}{'-bias' if b else ''}")
          for shape in SHAPES for f, t, b in CASES if shape != "large-split-k" or (t < 3 and b)]


@pytest.mark.parametrize("large, heads, kv_heads, head_dim, in_features, fmt, tokens, with_bias", PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_kv_write_in_the_qkv_epilogue_are_the_projection_then_rope_store_kv(
        triton_interpreter, monkeypatch, fmt, dtype, large, heads, kv_heads, head_dim, in_features, with_bias,
        tokens) -> None:
    # Each token's q rotated into the output, its k rotated and v written at its slot, bit for bit
    # what the projection followed by rope_store_kv's kernel gives; no other slot written. Several
    # tokens: the few-row kernels.
    monkeypatch.setattr(split_k_module, "LARGE_TILING_MIN_WEIGHTS", 0 if large else 1 << 30)
    gen = torch.Generator().manual_seed(heads * head_dim + in_features)
    out_features = (heads + 2 * kv_heads) * head_dim
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    project, fused = _format(fmt, out_features, in_features, dtype, bias, gen)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    cos_sin = rope_cos_sin(rope_inv_freq(head_dim, 10000.0, {}), 64)
    cache = torch.randn(2, 2, 4, kv_heads, head_dim, generator=gen).to(dtype)  # [k/v, blocks, block size, KV, D]
    caches = [cache.clone(), cache.clone()]

    def rope(c: torch.Tensor) -> RopeKV:
        return RopeKV(torch.tensor([37, 12, 50][:tokens]), cos_sin, c[0], c[1], torch.tensor(slots), heads,
                      kv_heads, head_dim)

    slots = [5, 0, 7][:tokens]
    with nan_poisoned_allocations():
        q = fused(x, rope(caches[0]))
    expected = rope_store_qkv(project(x), rope(caches[1]))
    assert q.shape == (tokens, heads, head_dim)
    if tokens == 1:
        assert torch.equal(q, expected) and torch.equal(caches[0], caches[1])
    else:  # the interpreter's dot (numpy) may sum a permuted weight tile in another order; tests/gpu: bit for bit
        torch.testing.assert_close(q, expected, **FEW_ROWS_TOLERANCE[dtype])
        torch.testing.assert_close(caches[0], caches[1], **FEW_ROWS_TOLERANCE[dtype])
    written = (caches[0] != cache).any(-1).any(-1).flatten(1).any(0)  # the slots written, of 8
    assert written.tolist() == [i in slots for i in range(8)]
    if fmt == "float":
        with reference_kernels():  # and against the torch references of both
            reference = rope_store_qkv(project(x), rope(cache.clone()))
        torch.testing.assert_close(q, reference, **TOLERANCE[dtype])
