"""The Triton flash-decoding kernel against dense attention, on CPU through Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import decode_attention_triton, num_splits_for
from tests.kernels.conftest import nan_poisoned_allocations
from tests.kernels.test_attention import dense_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("verify", [False, True])
def test_decode_attention_matches_dense(triton_interpreter, dtype, num_splits, heads, kv_heads, verify) -> None:
    gen = torch.Generator().manual_seed(num_splits * 10 + heads)
    dim, block_size, num_blocks = 32, 4, 96
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    # Mid-block, a single token, block edges, several blocks, several 64-token tiles (the first
    # tile of each split is read partly before the wait for the previous kernel, the rest after).
    lens = [9, 1, 16, 30, 23, 4, 150]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    width = max(map(len, tables)) + 2  # wider than needed: entries past a sequence must not be read
    block_tables = torch.tensor([t + [10**6] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    # A verify step's rows read the keys of the drafts before them after the wait too.
    fresh = torch.tensor([max(0, n - 5) for n in lens], dtype=torch.int32) if verify else None
    with nan_poisoned_allocations():
        out = decode_attention_triton(q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32),
                                      dim**-0.5, num_splits, fresh)
    ref = torch.stack([
        dense_attention(q[i : i + 1], k_cache[t].flatten(0, 1)[:n], v_cache[t].flatten(0, 1)[:n], dim**-0.5)[0]
        for i, (t, n) in enumerate(zip(tables, lens))
    ])
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_splits_cover_the_gpu_and_depend_on_the_batch_shape_only() -> None:
    cpu = torch.device("cpu")  # sized as REFERENCE_SM_COUNT (an H200's 132 SMs)
    assert num_splits_for(1, 8, cpu) == 32 and num_splits_for(64, 8, cpu) == 1
    assert num_splits_for(8, 8, cpu) * 8 * 8 >= 132
