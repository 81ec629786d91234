"""The INT4 (AWQ) and FP8 linear kernels and their fused epilogues against their torch references on
a CUDA GPU, for decode and prefill row counts: the decode kernels at the projection sizes of the
Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B shapes, the rest at Llama-3.2-1B's (run through the
device tool; skipped without a GPU)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch

from engine.models.config import ModelConfig
from kernels.activation import silu_mul
from kernels.dispatch import programmatic_launch, programmatic_launches
from kernels.fp8_linear import (
    FP8, fp8_linear, fp8_linear_add_norm, fp8_linear_ref, fp8_linear_rope_kv, fp8_linear_triton, quantize_fp8,
    quantize_per_token, use_scaled_mm,
)
from kernels.int4_layout import pack_awq, repack_awq
from kernels.int4_linear import (TILE_GEMM_MAX_ROWS, int4_linear, int4_linear_add_norm, int4_linear_ref,
                                 int4_linear_rope_kv)
from kernels.rmsnorm import rms_norm
from kernels.rope import RopeKV, rope_cos_sin, rope_inv_freq, rope_store_qkv
from tests.gpu.shapes import LAYERS, projections, qkv_features
from tests.gpu.test_kernels_cuda import rel_err
from tests.kernels.conftest import nan_poisoned_allocations

# Rows 2 to FEW_ROWS go through the few-row kernels here, as the layers do not send them (split_k.FUSED_ROWS).
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("few_row_kernels")]

SHAPES = projections(LAYERS["llama-3.2-1b"])  # where one shape is enough
PROJECTIONS = list(SHAPES)
ROWS = [1, 8, 64, 512]  # decode GEMV, decode few rows, prefill
DTYPES = [torch.bfloat16, torch.float16]


def int4_weight(in_features: int, out_features: int, group_size: int = 128) -> tuple[torch.Tensor, ...]:
    """Random runtime-layout (weight, zeros, fp16 scales) on the GPU whose layer keeps O(1) activations
    O(1), made as the loader makes them: AWQ-packed, then repacked."""
    q = torch.randint(0, 16, (in_features, out_features), device="cuda")
    z = torch.randint(0, 16, (in_features // group_size, out_features), device="cuda")
    scales = (torch.rand(in_features // group_size, out_features, device="cuda") + 0.5) * 0.3 * in_features**-0.5
    return repack_awq(pack_awq(q), pack_awq(z), scales.half())


def replayed(fn: Callable[[], torch.Tensor], pdl: bool) -> torch.Tensor:
    """fn's output from a CUDA graph of it (captured after one eager call, which compiles), with or
    without programmatic dependent launch, after three replays."""
    with programmatic_launches() if pdl else contextlib.nullcontext():
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def fp8_weight(in_features: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8(torch.randn(out_features, in_features, device="cuda") * in_features**-0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("model", LAYERS)
def test_int4_linear(dtype: torch.dtype, rows: int, projection: str, model: str) -> None:
    shape = projections(LAYERS[model])[projection]
    w4 = int4_weight(*shape)
    x = torch.randn(rows, shape[0], device="cuda", dtype=dtype)
    with nan_poisoned_allocations():
        out = int4_linear(x, *w4, 128)
    assert out.dtype == dtype
    assert rel_err(out, int4_linear_ref(x, *w4, 128)) < 1e-2


@pytest.mark.parametrize("shape", [SHAPES["o"], SHAPES["down"]], ids=["o", "down"])
def test_int4_large_prefill_dequantizes_then_multiplies(shape: tuple[int, int]) -> None:
    w4 = int4_weight(*shape)
    x = torch.randn(TILE_GEMM_MAX_ROWS + 77, shape[0], device="cuda", dtype=torch.bfloat16)
    assert rel_err(int4_linear(x, *w4, 128), int4_linear_ref(x, *w4, 128)) < 1e-2


@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_int4_linear_group_sizes(group_size: int, rows: int) -> None:
    w4 = int4_weight(*SHAPES["qkv"], group_size)
    x = torch.randn(rows, SHAPES["qkv"][0], device="cuda", dtype=torch.bfloat16)
    with nan_poisoned_allocations():
        out = int4_linear(x, *w4, group_size)
    assert rel_err(out, int4_linear_ref(x, *w4, group_size)) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("model", LAYERS)
def test_fp8_linear(dtype: torch.dtype, rows: int, projection: str, model: str) -> None:
    shape = projections(LAYERS[model])[projection]
    weight, scale = fp8_weight(*shape)
    x = torch.randn(rows, shape[0], device="cuda", dtype=dtype)
    with nan_poisoned_allocations():
        out = fp8_linear(x, weight, scale)
    assert out.dtype == dtype
    ref = fp8_linear_ref(x, weight, scale)
    if use_scaled_mm(x, weight):
        # w8a8: x rounded to e4m3 per token. Against the reference on that same rounded x, only the
        # output rounding is left; against w8a16, the 3-bit mantissa of x costs about 2.5%.
        xq, scale_a = quantize_per_token(x)
        assert rel_err(out, fp8_linear_ref((xq.float() * scale_a).to(dtype), weight, scale)) < 1e-2
        assert rel_err(out, ref) < 5e-2
    else:
        assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("rows", [64, 512])
@pytest.mark.parametrize("shape", [SHAPES["o"], SHAPES["down"]], ids=["o", "down"])
def test_fp8_triton_prefill(rows: int, shape: tuple[int, int]) -> None:
    """The w8a16 kernel at prefill sizes: what fp8_linear runs where _scaled_mm cannot (pre-Ada GPUs)."""
    weight, scale = fp8_weight(*shape)
    x = torch.randn(rows, shape[0], device="cuda", dtype=torch.bfloat16)
    with nan_poisoned_allocations():
        out = fp8_linear_triton(x, weight, scale)
    assert rel_err(out, fp8_linear_ref(x, weight, scale)) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("model", LAYERS)
def test_gate_up_silu_mul_is_the_projection_then_the_activation_kernel(dtype: torch.dtype, rows: int, model: str
                                                                      ) -> None:
    """One row: SiLU·up in the one-row kernels' epilogue; 8: the activation kernel after the GEMM.
    Both bit for bit the projection stored, then silu_mul."""
    k, n = projections(LAYERS[model])["gate_up"]
    w4 = int4_weight(k, n)
    weight, scale = fp8_weight(k, n)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    with nan_poisoned_allocations():
        int4_out = int4_linear(x, *w4, 128, silu_mul=True)
        fp8_out = fp8_linear(x, weight, scale, silu_mul=True)
    assert int4_out.shape == fp8_out.shape == (rows, n // 2)
    assert torch.equal(int4_out, silu_mul(int4_linear(x, *w4, 128)))
    assert torch.equal(fp8_out, silu_mul(fp8_linear(x, weight, scale)))
    assert rel_err(int4_out, int4_linear_ref(x, *w4, 128, silu_mul=True)) < 1e-2


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_bias_and_batched_inputs(rows: int) -> None:
    in_features, out_features = SHAPES["qkv"]
    x = torch.randn(2, rows, in_features, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(out_features, device="cuda", dtype=torch.bfloat16)
    w4 = int4_weight(in_features, out_features)
    weight, scale = fp8_weight(in_features, out_features)
    with nan_poisoned_allocations():
        int4_out = int4_linear(x, *w4, 128, bias)
        fp8_out = fp8_linear(x, weight, scale, bias)
    assert int4_out.shape == fp8_out.shape == (2, rows, out_features)
    assert rel_err(int4_out, int4_linear_ref(x, *w4, 128, bias)) < 1e-2
    assert rel_err(fp8_out, fp8_linear_ref(x, weight, scale, bias)) < 5e-2  # 2 x 64 rows: w8a8 on Hopper


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 8])
def test_decode_kernels_replay_in_a_cuda_graph_with_new_inputs(rows: int) -> None:
    """Captured once (split-K partials and their sum included), replayed after x changes."""
    in_features, out_features = SHAPES["down"]
    w4 = int4_weight(in_features, out_features)
    weight, scale = fp8_weight(in_features, out_features)
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return int4_linear(x, *w4, 128), fp8_linear(x, weight, scale)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int4_out, fp8_out = step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_err(int4_out, int4_linear_ref(x, *w4, 128)) < 1e-2
    assert rel_err(fp8_out, fp8_linear_ref(x, weight, scale)) < 1e-2


def test_fp8_one_row_kernel_decodes_every_e4m3_value_exactly() -> None:
    """As the CPU test: one-hot rows pick out weight columns, so the output is the decoded bytes bit
    for bit. On Ada and Hopper this checks the hardware decode (cvt.rn.f16x2.e4m3x2); on older GPUs,
    that float32 subnormals (the integer decode's e4m3 subnormals / 2**120) are not flushed to zero."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaNs
    weight = codes.view(16, 16).view(FP8).cuda()
    ones = torch.ones(16, device="cuda")
    for k in range(16):
        x = torch.zeros(1, 16, device="cuda")
        x[0, k] = 1.0
        assert torch.equal(fp8_linear(x, weight, ones), weight.float()[:, k][None, :])


@torch.inference_mode()
def test_programmatic_launch_keeps_a_dependent_chain_exact() -> None:
    """A chain of our decode kernels, each reading the one before, in a CUDA graph: launched with
    PDL (each kernel starts while the previous one finishes and waits for its writes) the output is
    bit for bit the output without PDL."""
    k, n = SHAPES["gate_up"]
    w4_up, w4_down = int4_weight(k, n), int4_weight(n // 2, k)
    fp8_up, fp8_down = fp8_weight(k, n), fp8_weight(n // 2, k)
    norm = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    h = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        x, residual = rms_norm(h, norm, 1e-5)
        x = int4_linear(int4_linear(x, *w4_up, 128, silu_mul=True), *w4_down, 128)
        x, residual = rms_norm(x, norm, 1e-5, residual)
        return fp8_linear(fp8_linear(x, *fp8_up, silu_mul=True), *fp8_down) + residual

    assert not programmatic_launch(h)
    with programmatic_launches():
        assert programmatic_launch(h)
    outputs = [replayed(chain, pdl) for pdl in (False, True)]
    assert torch.isfinite(outputs[0]).all()
    assert torch.equal(outputs[0], outputs[1])


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("model", LAYERS)
def test_norm_folded_into_the_kernels(fmt: str, dtype: torch.dtype, rows: int, model: str) -> None:
    """Batch-1 decode's folded norm: o_proj and down_proj (int4: the GEMV's small and
    large tilings, split along K) end in the add-norm epilogue, QKV and gate/up (SiLU·up) scale their outputs by its
    NormScale; against rms_norm between the plain projections. Then the chain replayed in a CUDA
    graph with PDL gives the eager chain's output bit for bit."""
    if fmt == "int4":
        make = int4_weight

        def project(x, w, silu=False, norm_in=None):
            return int4_linear(x, *w, 128, silu_mul=silu, norm_in=norm_in)

        def add_norm(x, w, residual):
            return int4_linear_add_norm(x, *w, 128, None, residual, norm, 1e-5)
    else:
        make = fp8_weight

        def project(x, w, silu=False, norm_in=None):
            return fp8_linear(x, *w, silu_mul=silu, norm_in=norm_in)

        def add_norm(x, w, residual):
            return fp8_linear_add_norm(x, *w, None, residual, norm, 1e-5)

    shapes = projections(LAYERS[model])
    hidden = shapes["o"][1]
    residual = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    norm = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    chain = []
    for producer, consumer, silu in (("o", "gate_up", True), ("down", "qkv", False)):
        wp, wc = make(*shapes[producer]), make(*shapes[consumer])
        x = torch.randn(rows, shapes[producer][0], device="cuda", dtype=dtype)
        with nan_poisoned_allocations():
            u, h, scale = add_norm(x, wp, residual)
            out = project(u, wc, silu, scale)
        normed, new_residual = rms_norm(project(x, wp), norm, 1e-5, residual)
        assert rel_err(h, new_residual) < 1e-3
        assert rel_err(scale.apply(u), normed) < 1e-2
        assert rel_err(out, project(normed, wc, silu)) < 1e-2
        chain.append((x, wp, wc, silu))

    def step() -> torch.Tensor:
        r, outs = residual, []
        for x, wp, wc, silu in chain:
            u, r, scale = add_norm(x, wp, r)
            outs.append(project(u, wc, silu, scale))
        return torch.cat([o.flatten() for o in outs] + [r.flatten()])

    assert torch.equal(replayed(step, pdl=True), step())


@torch.inference_mode()
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("model", LAYERS)
def test_rope_and_kv_write_in_the_qkv_epilogue(fmt: str, dtype: torch.dtype, tokens: int, model: str) -> None:
    """The one-row QKV kernel with RoPE and the KV write as its epilogue: bit for bit the projection
    followed by rope_store_kv's kernel (q and both caches)."""
    layer = LAYERS[model]
    k, n = layer.hidden_size, qkv_features(layer)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    if fmt == "int4":
        w4 = int4_weight(k, n)
        project = lambda x: int4_linear(x, *w4, 128, bias)  # noqa: E731
        fused = lambda x, rope: int4_linear_rope_kv(x, *w4, 128, bias, None, rope)  # noqa: E731
    else:
        w8 = fp8_weight(k, n)
        project = lambda x: fp8_linear(x, *w8, bias)  # noqa: E731
        fused = lambda x, rope: fp8_linear_rope_kv(x, *w8, bias, None, rope)  # noqa: E731
    # Several inputs: a rounding the epilogue does apart from the projection shows on only some.
    torch.manual_seed(tokens)
    for _ in range(8):
        check_rope_epilogue(project, fused, torch.randn(tokens, k, device="cuda", dtype=dtype), layer)


def check_rope_epilogue(project: Callable[[torch.Tensor], torch.Tensor],
                        fused: Callable[[torch.Tensor, RopeKV], torch.Tensor], x: torch.Tensor, layer: ModelConfig
                        ) -> None:
    """A QKV kernel with the RoPE epilogue (fused) against its projection then rope_store_kv: q and
    both caches bit for bit, x's tokens at positions from 3,001 and every third slot from 517."""
    tokens, heads, kv_heads, head_dim = x.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    cos_sin = rope_cos_sin(rope_inv_freq(head_dim, 500000.0, {}), 4096).cuda()
    cache = torch.randn(2, 64, 16, kv_heads, head_dim, device="cuda", dtype=x.dtype)
    caches = [cache.clone(), cache.clone()]

    def rope(c: torch.Tensor) -> RopeKV:
        return RopeKV(torch.arange(3001, 3001 + tokens, device="cuda"), cos_sin, c[0], c[1],
                      torch.arange(517, 517 + 3 * tokens, 3, device="cuda"), heads, kv_heads, head_dim)

    with nan_poisoned_allocations():
        q = fused(x, rope(caches[0]))
    assert torch.equal(q, rope_store_qkv(project(x), rope(caches[1])))
    assert torch.equal(caches[0], caches[1]) and not torch.equal(caches[0], cache)
