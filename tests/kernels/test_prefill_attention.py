"""The Triton prefill/extend kernel against dense causal attention, on CPU through Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import AttentionMetadata, paged_attention
from kernels.prefill_attention import prefill_attention_triton
from tests.kernels.conftest import nan_poisoned_allocations
from tests.kernels.test_attention import dense_attention

# (seq_len, q_len): a first prefill over several tiles, a chunk after a cached prefix, a decode row,
# a one-token chunk at a block edge, a chunk that is the whole of a short sequence.
SHAPES = [(37, 37), (45, 19), (9, 1), (16, 1), (5, 5), (33, 18)]


def packed_batch(gen: torch.Generator, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block_size: int):
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n, _ in SHAPES]
    width = max(map(len, tables)) + 2  # entries past a sequence's blocks must not be read
    q_lens = [q for _, q in SHAPES]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor([n for n, _ in SHAPES], dtype=torch.int32),
        block_tables=torch.tensor([t + [10**6] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=q_lens, seq_lens_cpu=[n for n, _ in SHAPES],
    )
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
    starts = meta.query_start_loc.tolist()
    ref = torch.cat([
        dense_attention(q[starts[b] : starts[b + 1]], k_cache[t].flatten(0, 1)[:n], v_cache[t].flatten(0, 1)[:n], dim**-0.5)
        for b, (t, (n, _)) in enumerate(zip(tables, SHAPES))
    ])
    return q, k_cache, v_cache, meta, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_prefill_attention_matches_dense(triton_interpreter, dtype, heads, kv_heads) -> None:
    dim = 32
    q, k_cache, v_cache, meta, ref = packed_batch(torch.Generator().manual_seed(heads), dtype, heads, kv_heads, dim, 4)
    with nan_poisoned_allocations():
        out = prefill_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                       max(meta.query_lens_cpu), dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_mixed_batches_dispatch_to_the_prefill_kernel(triton_interpreter) -> None:
    q, k_cache, v_cache, meta, ref = packed_batch(torch.Generator().manual_seed(7), torch.float32, 6, 2, 16, 8)
    with nan_poisoned_allocations():
        out = paged_attention(q, k_cache, v_cache, meta, 16**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
