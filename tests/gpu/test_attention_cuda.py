"""The Triton decode and prefill/extend attention kernels against the torch reference on a CUDA GPU,
at the Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B head shapes (run through the device tool; skipped
without a GPU)."""
from __future__ import annotations

import pytest
import torch

from engine.models.config import ModelConfig
from kernels.attention import AttentionMetadata, dense_prefill, dense_prefill_attention, paged_attention, paged_attention_ref
from kernels.decode_attention import decode_attention_triton
from kernels.prefill_attention import prefill_attention_triton
from tests.gpu.shapes import LAYERS
from tests.gpu.test_kernels_cuda import rel_err
from tests.kernels.conftest import nan_poisoned_allocations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK_SIZE, NUM_BLOCKS = 16, 4096
DTYPES = [torch.bfloat16, torch.float16]


def batch(shapes: list[tuple[int, int]], layer: ModelConfig, dtype: torch.dtype):
    """Random caches, scattered block tables and packed queries for (seq_len, q_len) pairs."""
    kv_heads = layer.num_kv_heads
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, layer.head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    free = torch.randperm(NUM_BLOCKS).tolist()
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n, _ in shapes]
    q_lens = [q for _, q in shapes]
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for table, (n, q_len) in zip(tables, shapes) for p in range(n - q_len, n)]
    meta = AttentionMetadata.from_host(slots, q_lens, [n for n, _ in shapes], tables, kv_heads,
                                       torch.device("cuda"))
    q = torch.randn(sum(q_lens), layer.num_heads, layer.head_dim, device="cuda", dtype=dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", LAYERS)
@pytest.mark.parametrize("lens", [[1, 17, 300, 4097, 8192, 64, 1000, 2], [130] * 64])
def test_decode_attention(dtype, model, lens) -> None:
    layer = LAYERS[model]
    scale = layer.head_dim**-0.5
    q, k_cache, v_cache, meta = batch([(n, 1) for n in lens], layer, dtype)
    with nan_poisoned_allocations():
        out = decode_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                      meta.num_splits)
    assert rel_err(out, paged_attention_ref(q, k_cache, v_cache, meta, scale)) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", LAYERS)
def test_prefill_attention(dtype, model) -> None:
    layer = LAYERS[model]
    scale = layer.head_dim**-0.5
    # A long first prefill, a chunk after a cached prefix, decodes beside them, odd lengths.
    shapes = [(2048, 2048), (5000, 512), (700, 1), (37, 37), (4096, 1), (1500, 999)]
    q, k_cache, v_cache, meta = batch(shapes, layer, dtype)
    with nan_poisoned_allocations():
        out = prefill_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                       max(meta.query_lens_cpu), scale)
    assert rel_err(out, paged_attention_ref(q, k_cache, v_cache, meta, scale)) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", LAYERS)
def test_dense_prefill_attention(dtype, model) -> None:
    """Fresh long prompts go to cuDNN (keys gathered by slot); a cached prefix or a short prompt does not."""
    layer = LAYERS[model]
    scale = layer.head_dim**-0.5
    q, k_cache, v_cache, meta = batch([(1024, 1024), (3001, 3001)], layer, dtype)
    assert dense_prefill(q, meta)
    with nan_poisoned_allocations():
        out = dense_prefill_attention(q, k_cache, v_cache, meta, scale)
    assert rel_err(out, paged_attention_ref(q, k_cache, v_cache, meta, scale)) < 1e-2
    assert rel_err(paged_attention(q, k_cache, v_cache, meta, scale), out) < 1e-6
    for shapes in ([(1024, 1024), (3001, 2000)], [(1024, 1024), (1023, 1023)]):
        assert not dense_prefill(*batch(shapes, layer, dtype)[::3])
