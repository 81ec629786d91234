"""A step's first kernel: its token ids (placeholders resolved to the previous step's sampled ids),
their embedding rows, and the first layer's RMSNorm of them.

A decode step is launched before the step in flight has sampled, so its inputs name that step's
tokens by placeholder (-1 - row of its sampled ids). Resolving them, the embedding lookup and the
norm were seven small kernels at the start of every decode graph; here they are one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import launch_options, programmatic_launch, use_triton, wait_for_previous_kernel
from kernels.rmsnorm import normalized_row, rms_norm_ref


def resolve_placeholders(token_ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Replace placeholders (-1 - row) by the previous step's sampled ids prev[row] (no host sync)."""
    return torch.where(token_ids >= 0, token_ids, prev[(-1 - token_ids).clamp(min=0)])


def embed_rms_norm_ref(token_ids: torch.Tensor, prev: torch.Tensor | None, table: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: (RMSNorm of the embedding rows, the rows) of token_ids, placeholders resolved
    from prev."""
    ids = token_ids if prev is None else resolve_placeholders(token_ids, prev)
    return rms_norm_ref(torch.nn.functional.embedding(ids, table), norm_weight, eps)


@triton.jit
def _embed_rms_norm_kernel(ids_ptr, prev_ptr, table_ptr, stride_table, weight_ptr, out_ptr, rows_ptr, hidden, eps,
                           HAS_PREV: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # One program a token; its row stays in registers between the sum and the scaling.
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # never written: read before the wait
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0)
    tid = tl.load(ids_ptr + token)
    if HAS_PREV:
        tid = tl.where(tid >= 0, tid, tl.load(prev_ptr + tl.maximum(-1 - tid, 0)))
    x = tl.load(table_ptr + tid.to(tl.int64) * stride_table + cols, mask=mask, other=0.0)
    start = token.to(tl.int64) * hidden
    tl.store(rows_ptr + start + cols, x, mask=mask)
    tl.store(out_ptr + start + cols, normalized_row(x, weight, hidden, eps), mask=mask)


def embed_rms_norm(token_ids: torch.Tensor, prev: torch.Tensor | None, table: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """embed_rms_norm_ref's (normed [T, H], embedding rows [T, H]) for token_ids [T] (placeholders
    resolved from prev [rows], if given): one Triton program a token where use_triton says so."""
    if not use_triton(table):
        return embed_rms_norm_ref(token_ids, prev, table, norm_weight, eps)
    tokens, hidden = token_ids.shape[0], table.shape[1]
    rows = torch.empty(tokens, hidden, dtype=table.dtype, device=table.device)
    out = torch.empty(tokens, hidden, dtype=torch.promote_types(norm_weight.dtype, table.dtype), device=table.device)
    if tokens == 0:
        return out, rows
    block = triton.next_power_of_2(hidden)
    pdl = programmatic_launch(table)
    _embed_rms_norm_kernel[(tokens,)](
        token_ids, prev if prev is not None else token_ids, table, table.stride(0), norm_weight.contiguous(), out, rows,
        hidden, eps, HAS_PREV=prev is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8), PDL=pdl,
        **launch_options(pdl),
    )
    return out, rows
