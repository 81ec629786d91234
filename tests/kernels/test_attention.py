"""Paged attention's torch reference against plain causal attention over contiguous keys."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import AttentionMetadata, paged_attention


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, H, D] for the last q_len of k's positions; k, v: [L, KV, D]."""
    q_len, seq_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def test_mixed_prefill_chunks_and_decodes_match_dense_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 8, 2, 32, 4, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    # (seq_len, q_len): a decode, a first prefill, a later chunk, another decode, a 1-token chunk at a block edge.
    shapes = [(9, 1), (13, 13), (30, 7), (1, 1), (16, 1), (21, 5)]
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks, never shared
    tables, queries, expected = [], [], []
    for seq_len, q_len in shapes:
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table)
        k = k_cache[table].flatten(0, 1)[:seq_len]
        v = v_cache[table].flatten(0, 1)[:seq_len]
        q = torch.randn(q_len, heads, dim, generator=gen)
        queries.append(q)
        expected.append(dense_attention(q, k, v, dim**-0.5))
    width = max(map(len, tables))
    q_lens = [q for _, q in shapes]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),  # unused by attention itself
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor([s for s, _ in shapes], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=q_lens,
        seq_lens_cpu=[s for s, _ in shapes],
    )
    out = paged_attention(torch.cat(queries), k_cache, v_cache, meta, dim**-0.5)
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)
