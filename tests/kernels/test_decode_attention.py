"""The Triton flash-decoding kernel against dense attention, on CPU through Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

import kernels.decode_attention as decode_attention
from kernels.decode_attention import arrival_counts, decode_attention_triton, num_splits_for
from tests.kernels.conftest import nan_poisoned_allocations
from tests.kernels.test_attention import dense_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits,split_tokens", [(1, 256), (3, 256), (3, 64), (8, 64)],
                         ids=["one-split-grid", "one-pass", "splits-capped-by-the-grid", "splits-by-context"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_decode_attention_matches_dense(triton_interpreter, monkeypatch, dtype, num_splits, split_tokens, heads,
                                        kv_heads) -> None:
    """Each sequence's keys in one pass, or over as many splits as its context has split_tokens (up
    to the grid's), the last split to finish merging them; the counters are left at zero."""
    monkeypatch.setattr(decode_attention, "SPLIT_TOKENS", split_tokens)
    gen = torch.Generator().manual_seed(num_splits * 10 + heads)
    dim, block_size, num_blocks = 32, 4, 192
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    # Mid-block, a single token, block edges, several blocks, several 64-token tiles (the first
    # tile of each split is read partly before the wait for the previous kernel, the rest after).
    lens = [9, 1, 16, 30, 23, 4, 150, 300]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    width = max(map(len, tables)) + 2  # wider than needed: entries past a sequence must not be read
    block_tables = torch.tensor([t + [10**6] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    with nan_poisoned_allocations():
        out = decode_attention_triton(q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32),
                                      dim**-0.5, num_splits)
    ref = torch.stack([
        dense_attention(q[i : i + 1], k_cache[t].flatten(0, 1)[:n], v_cache[t].flatten(0, 1)[:n], dim**-0.5)[0]
        for i, (t, n) in enumerate(zip(tables, lens))
    ])
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert not arrival_counts(q.device, 0).any()


def test_splits_cover_the_gpu_and_depend_on_the_batch_shape_only() -> None:
    cpu = torch.device("cpu")  # sized as REFERENCE_SM_COUNT (an H200's 132 SMs)
    assert num_splits_for(1, 8, cpu) == 32 and num_splits_for(64, 8, cpu) == 1
    assert num_splits_for(8, 8, cpu) * 8 * 8 >= 132
