"""The float one-row GEMV and few-row kernel (kernels/float_linear.py) and their epilogues on a CUDA GPU, bf16 and fp16,
at the projection sizes of the Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B shapes, outputs poisoned
(skipped without a GPU): SiLU·up, the folded norm, and RoPE with the KV write."""
from __future__ import annotations

import pytest
import torch

from kernels import float_linear as float_linear_module
from kernels.activation import silu_mul
from kernels.float_linear import float_linear, float_linear_add_norm, float_linear_ref, float_linear_rope_kv, tma_fits
from kernels.rmsnorm import rms_norm
from tests.gpu.test_kernels_cuda import rel_err
from tests.gpu.shapes import LAYERS, projections, qkv_features
from tests.gpu.test_quant_kernels_cuda import check_rope_epilogue, replayed
from tests.kernels.conftest import nan_poisoned_allocations

# Rows 2 to FEW_ROWS go through the few-row kernels here in every dtype (the layers send float32 one row);
# each test runs with the layers' choice between the rows GEMV and the tensor-core kernel, and again
# with every small weight through the rows GEMV up to its most rows, split along K as the GEMV splits.
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("few_row_kernels", "rows_gemv")]


@pytest.fixture(params=["layers", "rows-gemv"])
def rows_gemv(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.param == "rows-gemv":
        monkeypatch.setattr(float_linear_module, "ROWS_GEMV_MOST", float_linear_module.ROWS_GEMV_MAX)
        monkeypatch.setattr(float_linear_module, "ROWS_GEMV_SPLIT", True)


DTYPES = [torch.bfloat16, torch.float16]


def weight(in_features: int, out_features: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(out_features, in_features, device="cuda") * in_features**-0.5).to(dtype)


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", LAYERS)
def test_gemv_against_the_reference(model: str, dtype: torch.dtype, rows: int) -> None:
    for name, (k, n) in projections(LAYERS[model]).items():
        w = weight(k, n, dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if name == "qkv" else None
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        with nan_poisoned_allocations():
            out = float_linear(x, w, bias)
        ref = float_linear_ref(x.float(), w.float(), None if bias is None else bias.float())
        assert rel_err(out, ref) < 1e-2, name
        if name == "gate_up":
            with nan_poisoned_allocations():
                fused = float_linear(x, w, silu_mul=True)
            apart = silu_mul(float_linear(x, w))
            if rows == 1 and tma_fits(x, w):  # TMA's kernel sums in steps of its own: as close as bf16 allows
                assert rel_err(fused, apart) < 1e-2, name
            else:  # the same sums, rounded to x's dtype before SiLU·up as the activation kernel does
                assert torch.equal(fused, apart), name


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", LAYERS)
def test_norm_folded_into_the_gemvs(model: str, dtype: torch.dtype, rows: int) -> None:
    """Batch-1 decode's folded norm: o_proj and down_proj end in the add-norm epilogue, gate/up
    (SiLU·up) and QKV scale their outputs by its NormScale; against rms_norm between the plain
    projections. Then the chain replayed in a CUDA graph with PDL gives the eager chain's output
    bit for bit."""
    shapes = projections(LAYERS[model])
    hidden = shapes["o"][1]
    residual = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    norm = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    chain = []
    for producer, consumer, silu in (("o", "gate_up", True), ("down", "qkv", False)):
        wp, wc = weight(*shapes[producer], dtype), weight(*shapes[consumer], dtype)
        x = torch.randn(rows, shapes[producer][0], device="cuda", dtype=dtype)
        with nan_poisoned_allocations():
            u, h, scale = float_linear_add_norm(x, wp, None, residual, norm, 1e-5)
            out = float_linear(u, wc, silu_mul=silu, norm_in=scale)
        normed, new_residual = rms_norm(float_linear(x, wp), norm, 1e-5, residual)
        assert rel_err(h, new_residual) < 1e-3
        assert rel_err(scale.apply(u), normed) < 1e-2
        assert rel_err(out, float_linear(normed, wc, silu_mul=silu)) < 1e-2
        chain.append((x, wp, wc, silu))

    def step() -> torch.Tensor:
        r, outs = residual, []
        for x, wp, wc, silu in chain:
            u, r, scale = float_linear_add_norm(x, wp, None, r, norm, 1e-5)
            outs.append(float_linear(u, wc, silu_mul=silu, norm_in=scale))
        return torch.cat([o.flatten() for o in outs] + [r.flatten()])

    assert torch.equal(replayed(step, pdl=True), step())


@torch.inference_mode()
@pytest.mark.parametrize("tokens", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", LAYERS)
def test_rope_and_kv_write_in_the_qkv_epilogue(model: str, dtype: torch.dtype, tokens: int) -> None:
    """The QKV GEMV with RoPE and the KV write as its epilogue: bit for bit the projection followed
    by rope_store_kv's kernel (q, and both caches), with a Qwen2-style bias."""
    layer = LAYERS[model]
    w, bias = weight(layer.hidden_size, qkv_features(layer), dtype), torch.randn(qkv_features(layer), device="cuda", dtype=dtype)
    check_rope_epilogue(lambda x: float_linear(x, w, bias), lambda x, rope: float_linear_rope_kv(x, w, bias, None, rope),
                        torch.randn(tokens, layer.hidden_size, device="cuda", dtype=dtype), layer)

