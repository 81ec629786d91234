"""The Triton RMSNorm, SiLU·mul and RoPE + KV-write kernels against their torch references, on CPU
through Triton's interpreter (float32 and float16; the interpreter gets bfloat16 wrong)."""
from __future__ import annotations

import os

import pytest
import torch

from kernels.activation import silu_mul_ref, silu_mul_triton
from kernels.dispatch import use_triton
from kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from kernels.rope import rope_cos_sin, rope_inv_freq, rope_store_kv_ref, rope_store_kv_triton
from tests.kernels.conftest import nan_poisoned_allocations

pytestmark = pytest.mark.usefixtures("triton_interpreter")

DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def test_dispatch_follows_the_device_and_triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    assert os.environ["TRITON_INTERPRET"] == "1" and use_triton(torch.zeros(1))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not use_triton(torch.zeros(1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200, 256])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    x = torch.randn(5, hidden, dtype=dtype)
    residual = torch.randn(5, hidden, dtype=dtype) if with_residual else None
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    with nan_poisoned_allocations():
        out, new_residual = rms_norm_triton(x, weight, 1e-5, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    assert torch.equal(new_residual, ref_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 128), (3, 200), (4, 3072), (2, 3, 64)])  # 3072: two column blocks
def test_silu_mul(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=dtype)
    with nan_poisoned_allocations():
        out = silu_mul_triton(x)
    torch.testing.assert_close(out, silu_mul_ref(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("merged", [True, False], ids=["qkv-views", "contiguous"])
def test_rope_store_kv(dtype: torch.dtype, head_dim: int, merged: bool) -> None:
    tokens, heads, kv_heads, num_blocks, block_size = 6, 4, 2, 8, 4
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    cos_sin = rope_cos_sin(rope_inv_freq(head_dim, 500000.0, scaling), 256)
    positions = torch.randint(0, 256, (tokens,))
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    if merged:  # as the model passes them: strided views into one QKV projection output
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    else:
        q, k, v = (torch.randn(tokens, n, head_dim, dtype=dtype) for n in (heads, kv_heads, kv_heads))
    caches = [torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype) for _ in range(4)]
    k_cache, v_cache, k_ref, v_ref = caches
    with nan_poisoned_allocations():
        q_out = rope_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    q_ref = rope_store_kv_ref(q, k, v, positions, cos_sin, k_ref, v_ref, slots)
    torch.testing.assert_close(q_out, q_ref, **TOLERANCE[dtype])
    flat = (-1, kv_heads, head_dim)
    torch.testing.assert_close(k_cache.view(flat)[slots], k_ref.view(flat)[slots], **TOLERANCE[dtype])
    assert torch.equal(v_cache.view(flat)[slots], v)
    unwritten = torch.ones(num_blocks * block_size, dtype=torch.bool)
    unwritten[slots] = False
    assert torch.isnan(k_cache.view(flat)[unwritten]).all() and torch.isnan(v_cache.view(flat)[unwritten]).all()
