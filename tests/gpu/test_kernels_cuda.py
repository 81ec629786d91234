"""The Triton RMSNorm, SiLU·mul, RoPE + KV-write and sampling kernels against their torch references on a CUDA
GPU, at the Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B layer sizes (run through the device tool; skipped
without a GPU)."""
from __future__ import annotations

import pytest
import torch

from engine.models.config import ModelConfig
from kernels.activation import silu_mul_ref, silu_mul_triton
from kernels.dispatch import use_triton
from kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from kernels.rope import rope_cos_sin, rope_inv_freq, rope_store_kv_ref, rope_store_kv_triton
from kernels.sampling import gumbel_argmax, gumbel_argmax_ref
from tests.gpu.shapes import LAYERS
from tests.kernels.conftest import nan_poisoned_allocations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS = 512
LLAMA_1B = LAYERS["llama-3.2-1b"]  # where one shape is enough
NUM_BLOCKS, BLOCK_SIZE, MAX_POSITIONS = 64, 16, 8192
DTYPES = [torch.bfloat16, torch.float16]
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float32; NaN (so any comparison fails) if out has an unwritten NaN."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def qkv_views(dtype: torch.dtype, layer: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model passes them: strided views into one merged QKV projection output."""
    heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    q, k, v = torch.randn(TOKENS, sum(sizes), device="cuda", dtype=dtype).split(sizes, dim=-1)
    return q.view(TOKENS, heads, head_dim), k.view(TOKENS, kv_heads, head_dim), v.view(TOKENS, kv_heads, head_dim)


def nan_caches(dtype: torch.dtype, layer: ModelConfig) -> list[torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
    return [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for _ in range(2)]


def test_cuda_tensors_take_the_triton_path() -> None:
    assert use_triton(torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("model", LAYERS)
def test_rms_norm(dtype: torch.dtype, with_residual: bool, model: str) -> None:
    hidden = LAYERS[model].hidden_size
    x = torch.randn(TOKENS, hidden, device="cuda", dtype=dtype)
    residual = torch.randn_like(x) if with_residual else None
    weight = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    with nan_poisoned_allocations():
        out, new_residual = rms_norm_triton(x, weight, 1e-5, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    assert rel_err(out, ref_out) < 1e-2
    assert rel_err(new_residual, ref_residual) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_widest_row(dtype: torch.dtype) -> None:
    x, weight = torch.randn(64, 8192, device="cuda", dtype=dtype), torch.ones(8192, device="cuda", dtype=dtype)
    with nan_poisoned_allocations():
        out, _ = rms_norm_triton(x, weight, 1e-5)
    assert rel_err(out, rms_norm_ref(x, weight, 1e-5)[0]) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", LAYERS)
def test_silu_mul(dtype: torch.dtype, model: str) -> None:
    x = torch.randn(TOKENS, 2 * LAYERS[model].intermediate_size, device="cuda", dtype=dtype)
    with nan_poisoned_allocations():
        out = silu_mul_triton(x)
    assert rel_err(out, silu_mul_ref(x)) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", LAYERS)
def test_rope_store_kv(dtype: torch.dtype, model: str) -> None:
    layer = LAYERS[model]
    cos_sin = rope_cos_sin(rope_inv_freq(layer.head_dim, 500000.0, LLAMA3_SCALING), MAX_POSITIONS).cuda()
    q, k, v = qkv_views(dtype, layer)
    positions = torch.randint(0, MAX_POSITIONS, (TOKENS,), device="cuda")
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device="cuda")[:TOKENS]
    (k_cache, v_cache), (k_ref, v_ref) = nan_caches(dtype, layer), nan_caches(dtype, layer)
    with nan_poisoned_allocations():
        q_out = rope_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    q_ref = rope_store_kv_ref(q, k, v, positions, cos_sin, k_ref, v_ref, slots)
    flat = (-1, layer.num_kv_heads, layer.head_dim)
    assert rel_err(q_out, q_ref) < 1e-2
    assert rel_err(k_cache.view(flat)[slots], k_ref.view(flat)[slots]) < 1e-2
    assert torch.equal(v_cache.view(flat)[slots], v)
    unwritten = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device="cuda")
    unwritten[slots] = False
    assert torch.isnan(k_cache.view(flat)[unwritten]).all() and torch.isnan(v_cache.view(flat)[unwritten]).all()


@torch.inference_mode()
def test_kernels_replay_in_a_cuda_graph_with_new_inputs() -> None:
    """Captured once, replayed after the static inputs change: no host syncs or data-dependent shapes."""
    dtype = torch.bfloat16
    cos_sin = rope_cos_sin(rope_inv_freq(LLAMA_1B.head_dim, 500000.0, LLAMA3_SCALING), MAX_POSITIONS).cuda()
    q, k, v = qkv_views(dtype, LLAMA_1B)
    x = torch.randn(TOKENS, LLAMA_1B.hidden_size, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    weight = (torch.rand(LLAMA_1B.hidden_size, device="cuda") + 0.5).to(dtype)
    gate_up = torch.randn(TOKENS, 2 * LLAMA_1B.intermediate_size, device="cuda", dtype=dtype)
    positions = torch.zeros(TOKENS, dtype=torch.int64, device="cuda")
    slots = torch.arange(TOKENS, device="cuda")
    k_cache, v_cache = nan_caches(dtype, LLAMA_1B)

    def step() -> tuple[torch.Tensor, ...]:
        q_out = rope_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
        return (q_out, *rms_norm_triton(x, weight, 1e-5, residual), silu_mul_triton(gate_up))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for t in (q, k, v, x, residual, gate_up):
        t.copy_(torch.randn_like(t))
    positions.copy_(torch.randint(0, MAX_POSITIONS, (TOKENS,), device="cuda"))
    slots.copy_(torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device="cuda")[:TOKENS])
    graph.replay()
    k_ref, v_ref = nan_caches(dtype, LLAMA_1B)
    expected = (rope_store_kv_ref(q, k, v, positions, cos_sin, k_ref, v_ref, slots),
                *rms_norm_ref(x, weight, 1e-5, residual), silu_mul_ref(gate_up))
    for out, ref in zip(outputs, expected):
        assert rel_err(out, ref) < 1e-2
    flat = (-1, LLAMA_1B.num_kv_heads, LLAMA_1B.head_dim)
    assert rel_err(k_cache.view(flat)[slots], k_ref.view(flat)[slots]) < 1e-2
    assert torch.equal(v_cache.view(flat)[slots], v_ref.view(flat)[slots])


@pytest.mark.parametrize("vocab", [49152, 128256, 151936])
@pytest.mark.parametrize("batch", [1, 64])
def test_gumbel_argmax(vocab: int, batch: int) -> None:
    """The fused sampling kernel picks what its torch reference picks: greedy and sampled rows over
    strided logits, and over flat scores, where the noise alone decides."""
    logits = 3 * torch.randn(batch, vocab + 64, device="cuda")[:, :vocab]
    temperatures = [0.0 if i % 3 == 1 else 0.5 + (i % 5) * 0.3 for i in range(batch)]
    seeds, counters = [1000 + i - (1 << 63) * (i % 2) for i in range(batch)], [7 * i for i in range(batch)]
    assert torch.equal(gumbel_argmax(logits, temperatures, seeds, counters),
                       gumbel_argmax_ref(logits, temperatures, seeds, counters))
    flat = torch.zeros(batch, vocab, device="cuda")
    ones, threes = [1.0] * batch, [3] * batch
    assert torch.equal(gumbel_argmax(flat, ones, seeds, threes), gumbel_argmax_ref(flat, ones, seeds, threes))
