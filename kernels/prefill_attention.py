"""Prefill/extend attention over the paged KV cache in Triton (flash attention, variable lengths).

The queries of a step are packed back to back: sequence b owns rows query_start_loc[b] to
query_start_loc[b+1], the last q_len of its seq_len tokens, whose K/V (cached prefix blocks and the
chunk itself) are already in the cache. One program per (sequence, query head, tile of BLOCK_M
queries) walks the KV tiles it may see (causal: up to its last query's position), gathering each
BLOCK_N-token tile across KV blocks through the block table, with an online softmax. Decode rows
(q_len 1) in a mixed batch are one-row tiles of the same kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_tile import attend_kv_tile


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, query_start_ptr, lens_ptr,
    scale,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_pos, stride_c_kv,
    stride_tab,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    # The last query tiles see the most keys: they start first, so the short ones fill the tail.
    tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:  # the grid covers the longest chunk; shorter ones have idle tiles
        seq_len = tl.load(lens_ptr + seq)
        context = seq_len - q_len  # tokens before the chunk: cached prefix and earlier chunks
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_pos = context + rows
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_q_t + head * stride_q_h + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        kv_head = head // GROUP
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        table_ptr = tables_ptr + seq * stride_tab
        end = tl.minimum(seq_len, context + (tile + 1) * BLOCK_M)  # keys past the tile's last query are unseen
        # Key tiles before the tile's first query are seen whole by every row: no causal mask there.
        # Key 0 is seen by every row in the first tile, so m is finite from then on.
        unmasked = (context + tile * BLOCK_M) // BLOCK_N * BLOCK_N
        for start in range(0, unmasked, BLOCK_N):
            tok = start + offs
            valid = tok < end
            m, l, acc = attend_kv_tile(q, k_ptr, v_ptr, table_ptr, kv_head, tok, valid, valid[None, :],
                                       m, l, acc, scale, stride_c_blk, stride_c_pos, stride_c_kv, BLOCK_SIZE, HEAD_DIM, IEEE)
        for start in range(unmasked, end, BLOCK_N):
            tok = start + offs
            valid = tok < end
            seen = valid[None, :] & (tok[None, :] <= q_pos[:, None])
            m, l, acc = attend_kv_tile(q, k_ptr, v_ptr, table_ptr, kv_head, tok, valid, seen,
                                       m, l, acc, scale, stride_c_blk, stride_c_pos, stride_c_kv, BLOCK_SIZE, HEAD_DIM, IEEE)
        out = acc / l[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_o_t + head * stride_o_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
) -> torch.Tensor:
    """q: [T, H, D] packed queries; caches: [num_blocks, block_size, KV, D]; → [T, H, D].
    max_query_len (a host number) sizes the grid."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv, _ = k_cache.shape
    batch = seq_lens.shape[0]
    # Smaller tiles under the interpreter (CPU tests) and for float32, whose tiles take twice the registers.
    interpreted = q.device.type == "cpu"
    block_m = 16 if interpreted else (64 if q.dtype == torch.float32 or head_dim > 128 else 128)
    block_n = 16 if interpreted else (32 if q.dtype == torch.float32 or head_dim > 128 else 64)
    out = torch.empty_like(q)
    grid = (batch, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // num_kv, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        num_warps=4 if interpreted or block_m <= 64 else 8, num_stages=2,
    )
    return out
