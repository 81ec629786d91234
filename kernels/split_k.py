"""What the weight-only linear kernels (kernels/int4_linear.py, kernels/fp8_linear.py) share: how
their grids are tiled and split along K, and the epilogues that sum the splits and store the result
(bias, SiLU·up, and the add-norm that batch-1 decode folds into the projections).

Split-K needs no second kernel: each split stores its float32 partial, and the last split of an
output tile to finish sums them all (sum_splits). The one-row kernels (M = 1) are tiled by weight
size (LARGE_TILING_MIN_WEIGHTS) and split along K only when their rows alone leave SMs idle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import sm_count
from kernels.rmsnorm import NormScale
from kernels.rope import rope_operands, rope_rows, store_rope_kv

# Weights (N x K) from which the one-row kernels take their large tiling (large_tiling).
LARGE_TILING_MIN_WEIGHTS = 8 << 20
# The most rows the few-row kernels take: all rows in one 16-row tensor-core tile, with the one-row
# kernels' epilogues per row.
FEW_ROWS = 16
# The most rows the FP8 and INT4 layers send through the epilogue kernels: the one-row GEMVs only, as
# their few-row kernels measured slower than the tile GEMM plus the separate norm and RoPE kernels
# (float weights take more: kernels/float_linear.py's FLOAT_FUSED_ROWS; docs/performance.md).
FUSED_ROWS = 1


def few_rows(x: torch.Tensor, most: int | None = None) -> bool:
    """Whether x [..., K] has 1 to `most` (default FUSED_ROWS) rows: the rows the linear kernels'
    epilogues take."""
    most = FUSED_ROWS if most is None else most
    return x.shape[-1] > 0 and 1 <= x.numel() // x.shape[-1] <= most


@triton.jit
def tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program_id(0), GROUP_M row tiles at a time so that neighbouring programs
    share weight tiles in L2 (with one row tile, as in decode, pid_n is the program id)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    in_group = pid % (GROUP_M * num_n)
    return first_m + in_group % rows_in_group, in_group // rows_in_group


@triton.jit
def sum_splits(acc, part_ptr, count_ptr, offs, mask, numel, SPLIT_K: tl.constexpr):
    """Split-K without a second kernel (a launch less per projection): each split stores its float32
    partial `acc` (at `offs` of a [SPLIT_K, numel] buffer) and counts itself in at its tile's
    counter; the last split to arrive gets the sum of them all, the others a mask of False, so only
    the last stores the result. It sets the counter back to zero for the next call (CUDA graph
    replays included). Without split-K: (acc, mask) as they are."""
    if SPLIT_K > 1:
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * numel + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the count says so (release below)
        arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        mask = mask & last
        acc = tl.zeros_like(acc)
        for split in range(SPLIT_K):  # .cg: from L2, where the other SMs' partials are
            acc += tl.load(part_ptr + split * numel + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tl.program_id(0), 0, mask=last)
    return acc, mask


@triton.jit
def store_tile(acc, out_ptr, bias_ptr, part_ptr, count_ptr, rows, cols, M, N, HAS_BIAS: tl.constexpr,
               SPLIT_K: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] float32 result in out's dtype, bias added, its splits summed first."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    acc, mask = sum_splits(acc, part_ptr, count_ptr, offs, mask, M * N, SPLIT_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def one_row_rows(N, ROWS: tl.constexpr, SILU_MUL: tl.constexpr):
    """(rows [ROWS], row_ok) of a one-row kernel's program over a weight [N, K]. With SILU_MUL (a
    merged gate/up weight, whose output is SiLU(gate) * up [N / 2]: see store_one_row) they are the
    program's ROWS / 2 gate rows, each followed by its up row N / 2 further on."""
    r = tl.arange(0, ROWS)
    if SILU_MUL:
        pair = tl.program_id(0) * (ROWS // 2) + r // 2
        rows = pair + (r % 2) * (N // 2)
        row_ok = pair < N // 2
    else:
        rows = tl.program_id(0) * ROWS + r
        row_ok = rows < N
    return rows, row_ok


@triton.jit
def store_one_row(y, rows, row_ok, out_ptr, bias_ptr, part_ptr, count_ptr, N, HAS_BIAS: tl.constexpr,
                  SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr, ROWS: tl.constexpr):
    """A one-row kernel's float32 outputs y [ROWS] for one_row_rows' rows, splits summed and bias
    added, into out. With SILU_MUL, SiLU(gate) * up of each pair into out[pair]: gate and up are
    rounded to out's dtype first, so the result is bit for bit what kernels/activation.py makes of
    the stored projection, without its kernel."""
    if SILU_MUL:
        y, ok = sum_splits(y, part_ptr, count_ptr, rows, row_ok, N, SPLIT_K)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.reshape(y, [ROWS // 2, 2]))
        gate_ok, _ = tl.split(tl.reshape(ok.to(tl.int32), [ROWS // 2, 2]))
        pairs = tl.program_id(0) * (ROWS // 2) + tl.arange(0, ROWS // 2)
        tl.store(out_ptr + pairs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=gate_ok != 0)
    else:
        store_tile(y[None, :], out_ptr, bias_ptr, part_ptr, count_ptr, tl.arange(0, 1), rows, 1, N, HAS_BIAS, SPLIT_K)


@triton.jit
def store_rope(y, rows, row_ok, bias_ptr, part_ptr, count_ptr, N, slot, cos, sin, q_out_ptr, k_cache_ptr, v_cache_ptr,
               cache_stride_slot, cache_stride_h, num_heads, num_kv_heads, HAS_BIAS: tl.constexpr,
               SPLIT_K: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr):
    """A one-row merged-QKV kernel's float32 outputs y [ROWS] for kernels/rope.py's rope_rows,
    splits summed and bias added, through store_rope_kv: q rotated into q_out, k and v into the
    caches (rope_operands gave the token's slot, cos and sin)."""
    y, ok = sum_splits(y, part_ptr, count_ptr, rows, row_ok, N, SPLIT_K)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    store_rope_kv(y[None, :], ok[None, :], tl.arange(0, 1), slot, cos, sin, q_out_ptr, k_cache_ptr, v_cache_ptr,
                  cache_stride_slot, cache_stride_h, num_heads, num_kv_heads, ROWS, HALF)


@triton.jit
def one_row_outputs(N, positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, dtype: tl.constexpr,
                    ROWS: tl.constexpr, SILU_MUL: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr):
    """A one-row kernel's weight rows and what its RoPE epilogue needs: (rows, row_ok, slot, cos,
    sin). one_row_rows' rows; with ROPE, kernels/rope.py's rope_rows and the token's rope_operands
    (host copies wrote them: they may be read before the wait for the previous kernel). Without
    ROPE, zeros stand in for slot, cos and sin."""
    if ROPE:
        rows, row_ok = rope_rows(N, ROWS, HALF)
        token = tl.arange(0, 1)
        slot, cos, sin = rope_operands(positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, token, token < 1,
                                       dtype, ROWS, HALF)
    else:
        rows, row_ok = one_row_rows(N, ROWS, SILU_MUL)
        slot = tl.zeros([1], dtype=tl.int64)
        cos = tl.zeros([1, ROWS // 2], dtype=tl.float32)
        sin = cos
    return rows, row_ok, slot, cos, sin


@triton.jit
def store_one_row_outputs(y, rows, row_ok, out_ptr, bias_ptr, part_ptr, count_ptr, N, bias, residual, norm_w,
                          residual_out_ptr, sumsq_ptr, slot, cos, sin, k_cache_ptr, v_cache_ptr, cache_stride_slot,
                          cache_stride_h, num_heads, num_kv_heads, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                          SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr, ROWS: tl.constexpr,
                          HALF: tl.constexpr):
    """A one-row kernel's epilogue over its float32 outputs y [ROWS] for one_row_outputs' rows: the
    add-norm (store_add_norm, with add_norm_operands' bias, residual and norm weight), RoPE with the
    KV write (store_rope, with one_row_outputs' slot, cos and sin), or the plain or SiLU·up store
    (store_one_row)."""
    if ADD_NORM:
        y, ok = sum_splits(y, part_ptr, count_ptr, rows, row_ok, N, SPLIT_K)
        store_add_norm(y, rows, ok, bias, residual, norm_w, out_ptr, residual_out_ptr, sumsq_ptr)
    elif ROPE:
        store_rope(y, rows, row_ok, bias_ptr, part_ptr, count_ptr, N, slot, cos, sin, out_ptr, k_cache_ptr,
                   v_cache_ptr, cache_stride_slot, cache_stride_h, num_heads, num_kv_heads, HAS_BIAS, SPLIT_K, ROWS,
                   HALF)
    else:
        store_one_row(y, rows, row_ok, out_ptr, bias_ptr, part_ptr, count_ptr, N, HAS_BIAS, SPLIT_K, SILU_MUL, ROWS)


@triton.jit
def matmul_outputs(M, N, positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, dtype: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, FEW: tl.constexpr,
                   SILU_MUL: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr):
    """A tile GEMM program's (rows, rows_ok, cols, col_ok, slot, cos, sin). FEW, a few-row kernel
    (M up to FEW_ROWS, one BLOCK_M tile; program_id(0) the tile of BLOCK_N weight rows, the output
    columns): one_row_outputs' per row, cols in one_row_rows' or rope_rows' order. Else tile_coords'
    tile, zeros standing in for slot, cos and sin."""
    if FEW:
        rows = tl.arange(0, BLOCK_M)
        if ROPE:
            cols, col_ok = rope_rows(N, BLOCK_N, HALF)
        else:
            cols, col_ok = one_row_rows(N, BLOCK_N, SILU_MUL)
    else:
        pid_m, pid_n = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
    rows_ok = rows < M
    if ROPE:
        slot, cos, sin = rope_operands(positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, rows, rows_ok,
                                       dtype, BLOCK_N, HALF)
    else:
        slot = tl.zeros([BLOCK_M], dtype=tl.int64)
        cos = tl.zeros([BLOCK_M, BLOCK_N // 2], dtype=tl.float32)
        sin = cos
    return rows, rows_ok, cols, col_ok, slot, cos, sin


@triton.jit
def store_matmul_outputs(acc, rows, rows_ok, cols, col_ok, out_ptr, bias_ptr, part_ptr, count_ptr, M, N, K,
                         in_sumsq_ptr, in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr, slot, cos,
                         sin, k_cache_ptr, v_cache_ptr, cache_stride_slot, cache_stride_h, num_heads, num_kv_heads,
                         HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, FEW: tl.constexpr, SILU_MUL: tl.constexpr,
                         NORM_IN: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """A tile GEMM's float32 tile acc [BLOCK_M, BLOCK_N] at matmul_outputs' rows and cols. FEW:
    store_one_row_outputs per row, each row's norm factor applied first (NORM_IN): the add-norm (one
    sum of squares a row), RoPE with the KV write (each row its token's slot), SiLU·up (gate and up
    rounded to out's dtype first), or the plain store, after the splits are summed. Else the plain
    store (store_tile)."""
    if FEW and NORM_IN:
        acc *= norm_factors(in_sumsq_ptr, rows, rows_ok, in_parts, K, eps, BLOCK_M, 256)[:, None]
    if FEW and (ADD_NORM or ROPE or SILU_MUL):
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        y, ok = sum_splits(acc, part_ptr, count_ptr, offs, rows_ok[:, None] & col_ok[None, :], M * N, SPLIT_K)
        if ADD_NORM:
            store_add_norm_rows(y, rows, cols, ok, bias_ptr, residual_ptr, norm_w_ptr, out_ptr, residual_out_ptr,
                                sumsq_ptr, N, HAS_BIAS)
        else:
            if HAS_BIAS:
                y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if ROPE:
                store_rope_kv(y, ok, rows, slot, cos, sin, out_ptr, k_cache_ptr, v_cache_ptr, cache_stride_slot,
                              cache_stride_h, num_heads, num_kv_heads, BLOCK_N, HALF)
            else:
                y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
                gate, up = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_N // 2, 2]))
                gate_ok, _ = tl.split(tl.reshape(ok.to(tl.int32), [BLOCK_M, BLOCK_N // 2, 2]))
                pairs = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                tl.store(out_ptr + rows.to(tl.int64)[:, None] * (N // 2) + pairs[None, :],
                         (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=gate_ok != 0)
    else:
        store_tile(acc, out_ptr, bias_ptr, part_ptr, count_ptr, rows, cols, M, N, HAS_BIAS, SPLIT_K)


@triton.jit
def norm_factor(sumsq_ptr, parts, hidden, eps, PARTS: tl.constexpr):
    """A NormScale's factor (kernels/rmsnorm.py): rsqrt(sum of its `parts` sums of squares / hidden
    + eps). Read from L2 (.cg): other SMs wrote them, in the kernel before."""
    offs = tl.arange(0, PARTS)
    total = tl.zeros([PARTS], dtype=tl.float32)
    for i in range(0, parts, PARTS):
        total += tl.load(sumsq_ptr + i + offs, mask=i + offs < parts, other=0.0, cache_modifier=".cg")
    return tl.rsqrt(tl.sum(total, axis=0) / hidden + eps)


@triton.jit
def add_norm_operands(rows, ok, bias_ptr, residual_ptr, norm_w_ptr, HAS_BIAS: tl.constexpr, ADD_NORM: tl.constexpr):
    """The add-norm epilogue's inputs for `rows` (ok: in range): (bias as float32, or 0.0, residual,
    norm weight); without ADD_NORM, zeros (store_one_row_outputs reads them only with it). Loaded
    before the wait for the previous kernel: the residual comes from an add-norm two or more
    kernels back (decode: the projection before the previous one), which finished before the
    previous kernel passed its own wait, so before this one was launched; it is read from L2 (.cg),
    where those writes are. Bias and weight are never written."""
    bias = 0.0
    residual = 0.0
    norm_w = 0.0
    if ADD_NORM:  # one return of one type: Triton checks every return against the others
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        residual = tl.load(residual_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg")
        norm_w = tl.load(norm_w_ptr + rows, mask=ok, other=0.0)
    return bias, residual, norm_w


@triton.jit
def store_add_norm(y, rows, ok, bias, residual, norm_w, out_ptr, residual_out_ptr, sumsq_ptr):
    """The add-norm epilogue (add_norm_ref) over a one-row kernel's final float32 outputs y for
    `rows` (ok: those this program stores), with add_norm_operands' bias, residual and norm weight:
    h = y + bias + residual into residual_out, h * norm weight into out, and the sum of h^2 over
    these rows into sumsq[program_id(0)], one slot per row tile (the next projection sums them:
    NormScale)."""
    h = (y + bias).to(out_ptr.dtype.element_ty) + residual
    tl.store(residual_out_ptr + rows, h, mask=ok)
    tl.store(out_ptr + rows, h * norm_w, mask=ok)
    hf = tl.where(ok, h.to(tl.float32), 0.0)
    tl.store(sumsq_ptr + tl.program_id(0), tl.sum(hf * hf, axis=0), mask=tl.max(ok.to(tl.int32), axis=0) > 0)


@triton.jit
def norm_factors(sumsq_ptr, rows, rows_ok, parts, hidden, eps, BLOCK_M: tl.constexpr, PARTS: tl.constexpr):
    """norm_factor for several rows: each row's NormScale factor [BLOCK_M] from a [rows, parts]
    tensor of partial sums of squares."""
    offs = tl.arange(0, PARTS)
    total = tl.zeros([BLOCK_M, PARTS], dtype=tl.float32)
    for i in range(0, parts, PARTS):
        total += tl.load(sumsq_ptr + rows.to(tl.int64)[:, None] * parts + i + offs[None, :],
                         mask=rows_ok[:, None] & (i + offs < parts)[None, :], other=0.0, cache_modifier=".cg")
    return tl.rsqrt(tl.sum(total, axis=1) / hidden + eps)


@triton.jit
def store_add_norm_rows(y, rows, cols, ok, bias_ptr, residual_ptr, norm_w_ptr, out_ptr, residual_out_ptr, sumsq_ptr, N,
                        HAS_BIAS: tl.constexpr):
    """store_add_norm for several rows: y [BLOCK_M, BLOCK_N] the final float32 outputs at (rows,
    cols) of [M, N] (ok: those this program stores); the sums of h^2 go to sumsq [M, tiles] at
    column program_id(0)."""
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    residual = tl.load(residual_ptr + offs, mask=ok, other=0.0)
    norm_w = tl.load(norm_w_ptr + cols, mask=cols < N, other=0.0)
    h = y.to(out_ptr.dtype.element_ty) + residual
    tl.store(residual_out_ptr + offs, h, mask=ok)
    tl.store(out_ptr + offs, h * norm_w[None, :], mask=ok)
    hf = tl.where(ok, h.to(tl.float32), 0.0)
    tl.store(sumsq_ptr + rows * tl.num_programs(0) + tl.program_id(0), tl.sum(hf * hf, axis=1),
             mask=tl.max(ok.to(tl.int32), axis=1) > 0)


_TILE_COUNTS: dict[torch.device, torch.Tensor] = {}  # per device: split-K's arrival counters


def split_workspace(out: torch.Tensor, split_k: int, tiles: int, cols: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_splits' buffers for `out` [rows, cols]: the float32 partials [SPLIT_K, rows, cols] (cols
    given when the partials are wider than out: before SiLU·up)
    and the device's per-tile arrival counters (zero between calls; kernels on one stream never
    overlap, so they share them). The counters are made on the first call, which precedes any graph
    capture, and are never outgrown: K is split only on grids of fewer than four programs per SM.
    Without split-K neither is read: `out` stands in for both."""
    if split_k == 1:
        return out, out
    counts = _TILE_COUNTS.get(out.device)
    if counts is None or counts.numel() < tiles:
        counts = _TILE_COUNTS[out.device] = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=out.device)
    shape = (out.shape[0], cols or out.shape[1])
    return torch.empty(split_k, *shape, dtype=torch.float32, device=out.device), counts


def split_k_for(rows: int, num_tiles: int, k_tiles: int, k: int, device: torch.device, per_sm: int = 4
                ) -> tuple[int, int]:
    """(SPLIT_K, K tiles per split) for a grid of `num_tiles` output tiles over `k_tiles` K tiles:
    enough splits that about `per_sm` programs run per SM, while the float32 partials (written and read
    back: 8 * SPLIT_K * rows bytes per column) stay under the weight bytes (k / 2 per column for int4,
    k for fp8, so k / 2 bounds both). Depends on shapes only, so a CUDA graph keeps it."""
    wanted = triton.cdiv(per_sm * sm_count(device), num_tiles)
    split_k = max(1, min(wanted, k // (16 * rows), k_tiles, 32))
    per_split = triton.cdiv(k_tiles, split_k)
    return triton.cdiv(k_tiles, per_split), per_split


def gemv_split(tiles: int, words: int, block_w: int, device: torch.device, per_sm: int = 8) -> tuple[int, int]:
    """(SPLIT_K, words per split) of a one-row kernel over `tiles` row tiles and `words` K-words a
    row: a grid under per_sm / 2 programs per SM is split along K to about per_sm (each split a
    whole number of BLOCK_W steps); larger grids already fill the GPU and are not split."""
    sms = sm_count(device)
    if tiles >= per_sm * sms // 2:
        return 1, words
    split = max(1, min(triton.cdiv(per_sm * sms, tiles), words // block_w, 32))
    per_split = triton.cdiv(triton.cdiv(words, split), block_w) * block_w
    return triton.cdiv(words, per_split), per_split


def large_tiling(out_features: int, in_features: int) -> bool:
    """Whether a one-row kernel takes its large weights' tiling for a weight [out_features,
    in_features]. A small weight is latency-bound: few rows a program, its rows read whole before
    the wait for the previous kernel. A large one is bound by instruction issue: 16 rows a program
    (each kernel's gemv_config has the rest)."""
    return out_features * in_features >= LARGE_TILING_MIN_WEIGHTS


def matmul_config(rows: int) -> dict[str, int]:
    """Tile sizes of the dot kernels by batch rows: a few rows (decode: one 16-row tensor-core tile,
    split-K) or prefill (a tiled GEMM)."""
    if rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4)
    if rows <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def norm_arguments(out: torch.Tensor, tiles: int, norm_in: NormScale | None,
                   add_norm: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> tuple[tuple, torch.Tensor | None, torch.Tensor | None]:
    """A linear kernel's norm arguments (in_sumsq, in_parts, eps, residual, norm_w, residual_out,
    sumsq; `out` stands in for those not read), and the add-norm outputs it writes (the new
    residual [M, N] and the float32 sums of squares [M, tiles], one per row and tile), or None, None."""
    in_sumsq, in_parts, eps = (norm_in.sumsq, norm_in.sumsq.shape[-1], norm_in.eps) if norm_in else (out, 0, 0.0)
    if add_norm is None:
        return (in_sumsq, in_parts, eps, out, out, out, out), None, None
    residual_out = torch.empty_like(out)
    sumsq = torch.empty(out.shape[0], tiles, dtype=torch.float32, device=out.device)
    args = (in_sumsq, in_parts, eps, add_norm[0].contiguous(), add_norm[1].contiguous(), residual_out, sumsq)
    return args, residual_out, sumsq

