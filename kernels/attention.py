"""Attention over the paged KV cache, for any mix of prefill chunks and decodes in one batch."""
from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.decode_attention import AttentionSplits, decode_attention_splits, decode_attention_triton, num_splits_for
from kernels.dispatch import to_device, use_triton
from kernels.prefill_attention import prefill_attention_triton

log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys are. Sequences are packed back to back in the batch.

    Sequence b owns query rows query_start_loc[b]:query_start_loc[b+1]; its keys are its first
    seq_lens[b] tokens, already in the cache at the slots its block table names. Its queries are
    the last (query length) of those tokens, so attention is causal with an offset.

    Built by `from_host` (a batch given as host lists) or `for_decode_graph` (a CUDA graph's static
    buffers), which both choose decode attention's split count for the device, or by
    `for_prefill_graph` (a prefill graph's static buffers: the prefill kernel always).
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32 (a decode graph's: int64)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    num_splits: int = 1  # decode attention's splits of each sequence's blocks (fixed per graph)
    # [B] int32 (a decode graph's: int64): each sequence's first key written in this step, which
    # decode attention reads only after waiting for the kernel that writes it (None: its last; a
    # verify step's rows share theirs)
    fresh: torch.Tensor | None = None

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens_cpu)

    @classmethod
    def from_host(cls, slots: list[int], query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                  num_kv_heads: int, device: torch.device, fresh: list[int] | None = None) -> AttentionMetadata:
        """A batch's metadata from host lists (the block tables padded with block 0 to the longest),
        copied to `device` behind its queued work: no host sync."""
        width = max(len(t) for t in block_tables)
        return cls(
            slot_mapping=to_device(slots, torch.int64, device),
            query_start_loc=to_device([0, *itertools.accumulate(query_lens)], torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            block_tables=to_device([t + [0] * (width - len(t)) for t in block_tables], torch.int32, device),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            num_splits=num_splits_for(len(seq_lens), num_kv_heads, device),
            fresh=None if fresh is None else to_device(fresh, torch.int32, device),
        )

    @classmethod
    def for_prefill_graph(cls, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, tokens: int) -> AttentionMetadata:
        """Up to `tokens` packed queries over a CUDA graph's static buffers, which every replay reads
        (the caller refills them): slot_mapping [tokens] int64, query_start_loc [B + 1] and seq_lens
        [B] int32 (a padding sequence has no queries), block_tables [B, max_blocks] int32. Attention
        takes the prefill kernel with a grid for `tokens` queries a sequence; the host lengths are
        placeholders that say so."""
        return cls(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            query_lens_cpu=[tokens],
            seq_lens_cpu=[tokens],
        )

    @classmethod
    def for_decode_graph(cls, slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                         num_kv_heads: int, fresh: torch.Tensor) -> AttentionMetadata:
        """One query per sequence over a CUDA graph's static buffers, which every replay reads (the
        caller refills them): slot_mapping [B] int64, seq_lens and fresh [B] int64, block_tables [B,
        max_blocks] int32. The host lengths are placeholders: decode attention reads only the device ones."""
        batch, device = seq_lens.shape[0], seq_lens.device
        return cls(
            slot_mapping=slot_mapping,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_lens=seq_lens,
            block_tables=block_tables,
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=[1] * batch,
            num_splits=num_splits_for(batch, num_kv_heads, device),
            fresh=fresh,
        )


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Torch reference. q: [T, H, D]; caches: [num_blocks, block_size, KV, D]; returns [T, H, D]."""
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    decode_rows = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    starts = [0, *itertools.accumulate(meta.query_lens_cpu)]  # from the host copy: no device sync per layer
    if decode_rows:
        # All single-token queries at once: gather each sequence's keys, padded, and mask the tail.
        rows = torch.tensor(decode_rows, device=q.device)
        max_len = max(meta.seq_lens_cpu[b] for b in decode_rows)
        num_blocks = -(-max_len // block_size)
        tables = meta.block_tables[rows, :num_blocks].long()
        k = k_cache[tables].flatten(1, 2)[:, :max_len]  # [B, L, KV, D]
        v = v_cache[tables].flatten(1, 2)[:, :max_len]
        lens = meta.seq_lens[rows].to(q.device)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, L]
        q_rows = torch.tensor([starts[b] for b in decode_rows], device=q.device)
        o = F.scaled_dot_product_attention(
            q[q_rows][:, :, None, :],  # [B, H, 1, D]
            k.transpose(1, 2).to(q.dtype),
            v.transpose(1, 2).to(q.dtype),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out[q_rows] = o[:, :, 0, :]
    for b, q_len in enumerate(meta.query_lens_cpu):
        if q_len == 1:
            continue
        seq_len = meta.seq_lens_cpu[b]
        num_blocks = -(-seq_len // block_size)
        table = meta.block_tables[b, :num_blocks].long()
        k = k_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1).to(q.dtype)  # [KV, L, D]
        v = v_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1).to(q.dtype)
        qb = q[starts[b] : starts[b] + q_len].transpose(0, 1)  # [H, q_len, D]
        group = qb.shape[0] // k.shape[0]
        if group > 1:  # flash attention's lower-right causal path takes equal head counts
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        # Query i sits at position seq_len - q_len + i and sees keys up to and including itself: a
        # causal mask aligned to the lower right (SDPA's own causal one when nothing came before).
        # Not torch.nn.attention.bias's causal_lower_right: importing it imports torch._dynamo (~1 s).
        before = seq_len - q_len
        mask = None if before == 0 else torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(before)
        o = F.scaled_dot_product_attention(qb[None], k[None], v[None], attn_mask=mask, is_causal=before == 0,
                                           scale=scale)[0]
        out[starts[b] : starts[b] + q_len] = o.transpose(0, 1)
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    keep_splits: bool = False,
) -> torch.Tensor | AttentionSplits:
    """Paged attention: decode batches through the Triton flash-decoding kernel (no host syncs, so
    graph-safe), batches with prefill chunks through the Triton prefill/extend kernel. With
    keep_splits, a decode batch spread over several splits comes back as its AttentionSplits, for
    o_proj to merge (or AttentionSplits.merged)."""
    if not use_triton(q):
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
    if meta.decode_only:  # a Python pass over the batch's query lengths: once a layer
        if keep_splits and meta.num_splits > 1:
            return decode_attention_splits(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                           meta.num_splits, meta.fresh)
        return decode_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, meta.num_splits,
                                       meta.fresh)
    if dense_prefill(q, meta):
        try:
            return dense_prefill_attention(q, k_cache, v_cache, meta, scale)
        except RuntimeError as e:  # raised before any launch: cuDNN has no kernel for this build or shape
            _dense_off.add(q.device)
            log.warning("cuDNN attention failed (%s); long prompts take the Triton prefill kernel from now on", e)
    return prefill_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                    max(meta.query_lens_cpu), scale)


# Fresh prompts of at least this many tokens each take cuDNN's fused attention through torch's SDPA
# on Hopper, faster there than our paged kernel (docs/performance.md). Cached prefixes, short chunks
# and CUDA graphs keep our kernel.
DENSE_MIN_TOKENS = 1024
_dense_off: set[torch.device] = set()  # devices where cuDNN refused once: the Triton kernel serves them


@functools.lru_cache(maxsize=None)
def _cudnn_attention(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0) and torch.backends.cuda.cudnn_sdp_enabled()


def dense_prefill(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this eager step's attention goes to dense_prefill_attention: every sequence a fresh
    prompt (no cached or earlier keys) of DENSE_MIN_TOKENS or more, half-precision heads cuDNN takes."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128
            and min(meta.query_lens_cpu) >= DENSE_MIN_TOKENS and meta.query_lens_cpu == meta.seq_lens_cpu
            and not torch.cuda.is_current_stream_capturing() and q.device not in _dense_off
            and _cudnn_attention(q.device))


def dense_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                            scale: float) -> torch.Tensor:
    """Causal attention of fresh prompts, a sequence at a time: their keys and values (rotated and
    written by the QKV projection) gathered from the cache by slot, then cuDNN's flash attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = torch.empty_like(q)
    keys, values = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [slots, KV, D]
    start = 0
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for q_len in meta.query_lens_cpu:
            rows = slice(start, start + q_len)
            slots = meta.slot_mapping[rows]
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys[slots].transpose(0, 1)[None],
                                               values[slots].transpose(0, 1)[None], is_causal=True, scale=scale,
                                               enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
            start += q_len
    return out
