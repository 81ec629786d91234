"""Paged attention's torch reference against plain causal attention over contiguous keys."""
from __future__ import annotations

import pytest
import torch

from kernels import attention
from kernels.attention import AttentionMetadata, paged_attention, paged_attention_ref
from kernels.decode_attention import num_splits_for

CPU = torch.device("cpu")


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
    q_lens = [q for _, q in shapes]
    slots = [0] * sum(q_lens)  # unused by attention itself
    meta = AttentionMetadata.from_host(slots, q_lens, [s for s, _ in shapes], tables, kv_heads, CPU)
    out = paged_attention(torch.cat(queries), k_cache, v_cache, meta, dim**-0.5)
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_metadata_from_host_lists() -> None:
    meta = AttentionMetadata.from_host([5, 6, 7, 40], [3, 1], [3, 9], [[1], [4, 2, 8]], num_kv_heads=2, device=CPU)
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == [5, 6, 7, 40]
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == meta.block_tables.dtype == torch.int32
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.seq_lens.tolist() == [3, 9]
    assert meta.block_tables.tolist() == [[1, 0, 0], [4, 2, 8]]  # padded with block 0
    assert meta.query_lens_cpu == [3, 1] and meta.seq_lens_cpu == [3, 9] and not meta.decode_only
    assert meta.num_splits == num_splits_for(2, 2, CPU) and meta.fresh is None
    verify = AttentionMetadata.from_host([9, 10], [1, 1], [9, 10], [[4, 2], [4, 2]], 2, CPU, fresh=[8, 8])
    assert verify.fresh.dtype == torch.int32 and verify.fresh.tolist() == [8, 8]


def test_metadata_for_a_decode_graph_reads_its_static_buffers() -> None:
    slots, lens = torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int32)
    tables = torch.zeros(4, 8, dtype=torch.int32)
    fresh = torch.zeros(4, dtype=torch.int32)
    meta = AttentionMetadata.for_decode_graph(slots, lens, tables, num_kv_heads=8, fresh=fresh)
    # The very tensors: every replay of the graph reads what the runner copied into them.
    assert meta.slot_mapping is slots and meta.seq_lens is lens and meta.block_tables is tables
    assert meta.fresh is fresh
    assert meta.decode_only and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.num_splits == num_splits_for(4, 8, CPU) == 9


def test_a_prompt_cudnn_refuses_takes_the_triton_kernel(triton_interpreter, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's attention (long fresh prompts on Hopper) raising before it launches is no failed
    request: that prompt and every later one on the device go to the Triton prefill kernel."""
    def refuse(*args) -> torch.Tensor:
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(attention, "dense_prefill", lambda q, meta: q.device not in attention._dense_off)
    monkeypatch.setattr(attention, "dense_prefill_attention", refuse)
    monkeypatch.setattr(attention, "_dense_off", set())
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 2, 16, 2, 16, generator=gen)  # K and V: [blocks, block size, KV heads, D]
    q = torch.randn(20, 4, 16, generator=gen)
    meta = AttentionMetadata.from_host(list(range(20)), [20], [20], [[0, 1]], 2, CPU)
    out = paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert attention._dense_off == {CPU}
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.25), atol=1e-5, rtol=1e-5)
