"""The flash-attention step that decode and prefill attention share (kernels/decode_attention.py,
kernels/prefill_attention.py): gather a tile of cached keys and values through a sequence's block
table, and fold it into an online softmax."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_tile_offsets(table_ptr, kv_head, tok, valid, stride_c_blk, stride_c_pos, stride_c_kv,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Offsets [T, D] into the K (or V) cache of one KV head at token positions tok (valid where in
    range), gathered across KV blocks through one sequence's block table."""
    dims = tl.arange(0, HEAD_DIM)
    block = tl.load(table_ptr + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return (block * stride_c_blk + (tok % BLOCK_SIZE) * stride_c_pos + kv_head * stride_c_kv)[:, None] + dims[None, :]


@triton.jit
def attend(q, k, v, seen, m, l, acc, scale, IEEE: tl.constexpr):
    """One online-softmax step of flash attention: the query rows q [R, D] against keys k and values
    v [T, D]; `seen` [R, T] masks what each row may attend to. Returns the updated (m, l, acc)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(seen, s * scale, float("-inf"))  # [R, T]
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l, acc * alpha[:, None] + pv


@triton.jit
def attend_kv_tile(q, k_ptr, v_ptr, table_ptr, kv_head, tok, valid, seen, m, l, acc, scale,
                   stride_c_blk, stride_c_pos, stride_c_kv,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr):
    """`attend` over the cached keys and values at positions tok (valid where in range)."""
    kv_offs = kv_tile_offsets(table_ptr, kv_head, tok, valid, stride_c_blk, stride_c_pos, stride_c_kv, BLOCK_SIZE,
                              HEAD_DIM)
    k = tl.load(k_ptr + kv_offs, mask=valid[:, None], other=0.0)  # [T, D]
    v = tl.load(v_ptr + kv_offs, mask=valid[:, None], other=0.0)
    return attend(q, k, v, seen, m, l, acc, scale, IEEE)
