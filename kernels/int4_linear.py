"""4-bit weight-only linear layers: AutoAWQ's GEMM layout, which checkpoints keep, and the N-major
layout the kernels run on.

For y = x @ W.T with W [out_features N, in_features K], quantized in groups of G input features per
output feature: W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G].

Checkpoints hold AutoAWQ's layout (engine/quantize.py writes it, the loader reads it):
  qweight  int32 [K, N // 8]       eight 4-bit weights of one input feature, packed in AWQ's order
  qzeros   int32 [K // G, N // 8]  the groups' zero points, packed the same way
  scales   fp16  [K // G, N]       the groups' scales
Packing puts column 8c + AWQ_ORDER[i] of a pack into bits 4i..4i+3 of its int32.

Once loaded, `repack_awq` turns it into the runtime layout, the only copy kept:
  weight   int32 [N, K // 8]   nibble j (bits 4j..4j+3) of word c holds k = 8c + j
  zeros    fp16  [N, K // G]   the zero points as floats (0..15, exact)
  scales   fp16  [N, K // G]
G is a multiple of 8, so the eight weights of a word share one group.

Kernels for x @ W.T, each reading a packed int32 once and dequantizing in registers (float32
accumulation), by the number of rows M:
  - M = 1 (decode): a GEMV on CUDA cores that turns nibbles into floats with a shift and a lop3
    (about 4 instructions a weight in all: cuobjdump of the sm_90 loop, bench/sass_count.py), tiled
    by weight size (see STREAM_WEIGHTS) and split along K when the rows alone leave SMs idle;
  - 1 < M <= GEMM_ROWS (decode batches, prefill chunks): a tl.dot GEMM whose weight tile
    [BLOCK_N, BLOCK_K] is each word interleaved 8 times along K and shifted per column;
  - M > GEMM_ROWS: the weight dequantized into x's dtype by a third kernel, then cuBLAS.
On an H200, per Llama-3.2-1B layer (bench: the four projections, bf16 activations), against the
kernels over AWQ's own K-major layout: 58 against 82 us at M = 1 (bf16 cuBLAS: 65; STREAM_WEIGHTS has
the one-row kernels' figures now), 72 against 96 at
M = 8, 107 against 130 at M = 64, 344 against 702 at M = 512, 628 (dequantize + cuBLAS) against
1,952 at M = 2,048.
The GEMM splits K when the output tiles alone would leave SMs idle; the last split of each output
tile to finish sums the splits' float32 partials (and adds the bias), in the same kernel.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import activation
from kernels.dispatch import launch_options, programmatic_launch, use_triton, wait_for_previous_kernel
from kernels.rmsnorm import NormScale, add_norm_ref

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its pack
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a pack sits in nibble AWQ_REVERSE_ORDER[j]
# Above this many rows (prefill chunks) the weight is dequantized into x's dtype once and the
# product is cuBLAS's; below, the tile GEMM reads the 4-bit weights directly. The H200 crossover
# per 1B layer: the tile GEMM wins at 512 rows (344 against 396 us), cuBLAS at 2,048 (628 against 749).
GEMM_ROWS = 1024
_REPACK_ROWS = 256  # input features repacked at a time: the unpacked int64s take 16x the packed bytes


def _pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] integers in 0..15 → int32 [...] with element i in bits 4i..4i+3."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=nibbles.device)
    packed = (nibbles.to(torch.int64) << shifts).sum(dim=-1)  # below 2**32: nibbles do not overlap
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # as a signed int32


def _unpack_words(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] → [R, C, 8] int32 in 0..15, nibble i at index i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return (packed[:, :, None] >> shifts) & 0xF


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] integers in 0..15 → [R, N // 8] int32 in AWQ's packing order."""
    rows, cols = values.shape
    return _pack_words(values.reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)])


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, N // 8] int32 → [R, N] int32 in 0..15 (the inverse of pack_awq)."""
    rows, packs = packed.shape
    return _unpack_words(packed)[:, :, list(AWQ_REVERSE_ORDER)].reshape(rows, packs * 8)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [K, N] in the scales' dtype, from AutoAWQ's layout."""
    q = unpack_awq(qweight)
    z = unpack_awq(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.repeat_interleave(group_size, dim=0)
    return ((q - z).to(scales.dtype) * s)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[R, K] integers in 0..15 → [R, K // 8] int32, k = 8c + j in nibble j of word c."""
    rows, cols = values.shape
    return _pack_words(values.reshape(rows, cols // 8, 8))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[R, K // 8] int32 → [R, K] int32 in 0..15 (the inverse of pack_int4)."""
    rows, words = packed.shape
    return _unpack_words(packed).reshape(rows, words * 8)


def repack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's (qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]) → the runtime layout
    (weight int32 [N, K/8], fp16 zeros [N, K/G], fp16 scales [N, K/G]), on the tensors' device."""
    in_features, packs = qweight.shape
    weight = torch.empty(packs * 8, in_features // 8, dtype=torch.int32, device=qweight.device)
    for k0 in range(0, in_features, _REPACK_ROWS):  # K is a multiple of 8: every slice holds whole words
        part = qweight[k0:k0 + _REPACK_ROWS]
        weight[:, k0 // 8:(k0 + part.shape[0]) // 8] = pack_int4(unpack_awq(part).t())
    zeros = unpack_awq(qzeros).t().to(torch.float16).contiguous()
    return weight, zeros, scales.t().to(torch.float16).contiguous()


def dequantize_int4(weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [N, K] in the scales' dtype, from the runtime layout (equal to dequantize_awq's, transposed)."""
    q = unpack_int4(weight)
    z = zeros.repeat_interleave(group_size, dim=1).to(torch.int32)
    s = scales.repeat_interleave(group_size, dim=1)
    return (q - z).to(scales.dtype) * s


def int4_linear_ref(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int, bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """Torch reference: dequantize, then x [M, K] @ W.T → [M, N] in x's dtype (SiLU·up → [M, N / 2])."""
    w = dequantize_int4(weight, zeros, scales, group_size).to(x.dtype)
    y = x @ w.t()
    y = y if bias is None else y + bias
    return activation.silu_mul_ref(y) if silu_mul else y


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
def norm_factor(sumsq_ptr, parts, hidden, eps, PARTS: tl.constexpr):
    """A NormScale's factor (kernels/rmsnorm.py): rsqrt(sum of its `parts` sums of squares / hidden
    + eps). Read from L2 (.cg): other SMs wrote them, in the kernel before."""
    offs = tl.arange(0, PARTS)
    total = tl.zeros([PARTS], dtype=tl.float32)
    for i in range(0, parts, PARTS):
        total += tl.load(sumsq_ptr + i + offs, mask=i + offs < parts, other=0.0, cache_modifier=".cg")
    return tl.rsqrt(tl.sum(total, axis=0) / hidden + eps)


@triton.jit
def add_norm_operands(rows, ok, bias_ptr, residual_ptr, norm_w_ptr, HAS_BIAS: tl.constexpr):
    """The add-norm epilogue's inputs for `rows` (ok: in range): (bias as float32, or 0.0, residual,
    norm weight). Loaded before the wait for the previous kernel: the residual comes from an
    add-norm two or more kernels back (decode: the projection before the previous one), which
    finished before the previous kernel passed its own wait, so before this one was launched; it is
    read from L2 (.cg), where those writes are. Bias and weight are never written."""
    bias = 0.0
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
def _nibbles(packed, shifts):
    """The 4-bit values at `shifts` of `packed` as float32 2**23 + q: OR-ing q into the mantissa of
    2**23 (0x4B000000) is cheaper than an int-to-float cvt (quarter rate); 2**23 cancels in q - z."""
    return (((packed >> shifts) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)


# A float32 with the exponent of 1.0 (a kernel argument: in a register, ptxas ORs it in the same
# lop3 as the mask). A nibble OR-ed into its mantissa at bit b reads 1 + q * 2**(b - 23).
ONE_BITS = 0x3F800000


@triton.jit
def _stream_step(w_tile, z_rows, s_rows, row_ok, c0, w_end, BLOCK_W: tl.constexpr, WPG: tl.constexpr):
    """The stream kernel's loads for words c0 .. c0 + BLOCK_W of its rows: the words [ROWS, BLOCK_W]
    (w_tile: the pointers of each row's words 0 .. BLOCK_W, one contiguous run a row, so that Triton
    gives each thread 4 adjacent words of 8 rows) and the groups' zero points and scales
    [ROWS, BLOCK_W / WPG]; zeros past w_end."""
    cols = c0 + tl.arange(0, BLOCK_W)
    p = tl.load(w_tile + c0, mask=row_ok[:, None] & (cols < w_end)[None, :], other=0)
    g = c0 // WPG + tl.arange(0, BLOCK_W // WPG)
    ok = row_ok[:, None] & (g < w_end // WPG)[None, :]
    z = tl.load(z_rows + g[None, :], mask=ok, other=0.0)
    s = tl.load(s_rows + g[None, :], mask=ok, other=0.0)
    return p, z, s


@triton.jit
def _word_inputs(x_ptr, cols, ok, BLOCK_W: tl.constexpr):
    """x at k = 8c + j for the words c [BLOCK_W], read as one contiguous [BLOCK_W, 8] run and split
    in registers: the even (j = 2i) and odd (j = 2i + 1) inputs for i = 0..3, eight [BLOCK_W]
    tensors in float32 (fewer instructions than eight strided 2-byte loads)."""
    xs = tl.load(x_ptr + (cols * 8)[:, None] + tl.arange(0, 8)[None, :], mask=ok[:, None], other=0.0)
    even, odd = tl.split(tl.reshape(xs.to(tl.float32), [BLOCK_W, 4, 2]))
    e02, e13 = tl.split(tl.reshape(even, [BLOCK_W, 2, 2]))
    o02, o13 = tl.split(tl.reshape(odd, [BLOCK_W, 2, 2]))
    e0, e2 = tl.split(e02)
    e1, e3 = tl.split(e13)
    o0, o2 = tl.split(o02)
    o1, o3 = tl.split(o13)
    return e0, o0, e1, o1, e2, o2, e3, o3


@triton.jit
def _add_nibble_pair(sums, t, one_bits, sixteen_bits, x_even, x_odd):
    """sums plus the products of the nibble pair that `t` (a shifted word) holds at mantissa bits 15
    and 19 with its inputs: (16 + q * 2**-4) * x_even + (1 + q' * 2**-4) * x_odd, one lop3 and one
    FMA each (see the stream kernel)."""
    sums += ((t & 0x78000) | sixteen_bits).to(tl.float32, bitcast=True) * x_even[None, :]
    sums += ((t & 0x780000) | one_bits).to(tl.float32, bitcast=True) * x_odd[None, :]
    return sums


@triton.jit
def _int4_stream_gemv_kernel(
    x_ptr, w_ptr, zeros_ptr, scales_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, stride_w, stride_g,
    words_per_split, one_bits, in_sumsq_ptr, in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr,
    HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr, NORM_IN: tl.constexpr, ADD_NORM: tl.constexpr, PDL: tl.constexpr,
):
    """One row of x against ROWS weight rows, BLOCK_W words of each per step (whole groups; split
    along K when the rows alone leave SMs idle). No int-to-float conversion: one shift brings two
    nibbles of a word (k = 8c + 2i and 8c + 2i + 1) to mantissa bits 15 and 19, one lop3 each masks
    one and ORs in an exponent, of 16.0 for k even and 1.0 for k odd, so the float32 reads
    16 + q * 2**-4 or 1 + q * 2**-4, and one FMA each multiplies it by x: 2.5 instructions a
    weight, with the constants summing to 16 * x_even + x_odd. Per group, q . x = 16 * (sum - that)
    and y += s * (q . x - z * sum(x)). The float32 sum keeps q . x to about 2**-20 of sum |x|
    (bfloat16 rounds the output to 2**-9). A step's words are one [ROWS, BLOCK_W] tile and x one
    contiguous run, so that each thread holds 4 adjacent words of 8 rows (each x value serves 8
    rows) whatever the group size and Triton version: over [ROWS, groups, words] tiles Triton 3.6
    (the GPU machine's) gave a thread 2 rows of 4 groups at group size 128 and 1 row at 32, and the
    loop took 1,235 and 1,608 instructions a step of 256 weights a thread, against 999 and 1,037
    now (bench/sass_count.py; Triton 3.7: 982 and 994 then, 965 and 1,003 now). SILU_MUL: the
    weight is a merged gate/up [N, K] and the output SiLU(gate) * up [N / 2] (store_one_row).
    NORM_IN: x is a NormScale's row, whose factor scales the outputs; ADD_NORM: the add-norm
    epilogue (store_add_norm)."""
    WPG: tl.constexpr = GROUP // 8  # words a group
    GPS: tl.constexpr = BLOCK_W // WPG  # groups a step
    rows, row_ok = one_row_rows(N, ROWS, SILU_MUL)
    w_begin = tl.program_id(1) * words_per_split
    # Split ends are whole groups (GROUP divides K, and words_per_split is whole steps): telling
    # Triton keeps the word masks constant over 4 words, so the loads stay 16 bytes wide.
    w_end = tl.multiple_of(tl.minimum(w_begin + words_per_split, K // 8), WPG)
    w_tile = w_ptr + rows.to(tl.int64)[:, None] * stride_w + tl.arange(0, BLOCK_W)[None, :]
    z_rows = zeros_ptr + rows.to(tl.int64)[:, None] * stride_g
    s_rows = scales_ptr + rows.to(tl.int64)[:, None] * stride_g
    # Weights are never written, so the first step's may be read before the previous kernel ends;
    # each step loads the next one's before its math.
    p, z, s = _stream_step(w_tile, z_rows, s_rows, row_ok, w_begin, w_end, BLOCK_W, WPG)
    if ADD_NORM:
        bias, residual, norm_w = add_norm_operands(rows, row_ok, bias_ptr, residual_ptr, norm_w_ptr, HAS_BIAS)
    wait_for_previous_kernel(PDL)
    if NORM_IN:  # its partial sums' latency under the loop's
        factor = norm_factor(in_sumsq_ptr, in_parts, K, eps, 256)
    sixteen_bits = one_bits + 0x2000000  # the exponent of 16.0: even nibbles read 16 + q / 16
    acc = tl.zeros([ROWS, GPS], dtype=tl.float32)
    for c0 in range(w_begin, w_end, BLOCK_W):
        p_next, z_next, s_next = _stream_step(w_tile, z_rows, s_rows, row_ok, c0 + BLOCK_W, w_end, BLOCK_W, WPG)
        cols = c0 + tl.arange(0, BLOCK_W)
        e0, o0, e1, o1, e2, o2, e3, o3 = _word_inputs(x_ptr, cols, cols < w_end, BLOCK_W)
        # Nibbles 2i and 2i + 1 (bits 8i..8i+7) to bits 15 and 19.
        sums = _add_nibble_pair(tl.zeros([ROWS, BLOCK_W], dtype=tl.float32), p << 15, one_bits, sixteen_bits, e0, o0)
        sums = _add_nibble_pair(sums, p << 7, one_bits, sixteen_bits, e1, o1)
        sums = _add_nibble_pair(sums, p >> 1, one_bits, sixteen_bits, e2, o2)
        sums = _add_nibble_pair(sums, p >> 9, one_bits, sixteen_bits, e3, o3)
        e = tl.sum(tl.reshape(e0 + e1 + e2 + e3, [GPS, WPG]), axis=1)
        o = tl.sum(tl.reshape(o0 + o1 + o2 + o3, [GPS, WPG]), axis=1)
        qx = tl.sum(tl.reshape(sums, [ROWS, GPS, WPG]), axis=2) - (16.0 * e + o)[None, :]  # q . x / 16
        acc += s.to(tl.float32) * (qx - z.to(tl.float32) * ((e + o) * 0.0625)[None, :])
        p, z, s = p_next, z_next, s_next
    y = tl.sum(acc, axis=1) * 16.0
    if NORM_IN:
        y *= factor
    if ADD_NORM:  # no SiLU
        y, ok = sum_splits(y, part_ptr, count_ptr, rows, row_ok, N, SPLIT_K)
        store_add_norm(y, rows, ok, bias, residual, norm_w, out_ptr, residual_out_ptr, sumsq_ptr)
    else:
        store_one_row(y, rows, row_ok, out_ptr, bias_ptr, part_ptr, count_ptr, N, HAS_BIAS, SPLIT_K, SILU_MUL, ROWS)


@triton.jit
def _int4_matmul_kernel(
    x_ptr, w_ptr, zeros_ptr, scales_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_w, stride_g, group_size, tiles_per_split,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    words = tl.arange(0, BLOCK_K // 8)
    shifts = (ks % 8) * 4  # k = 8c + j sits in nibble j of word c
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    g_cols = cols.to(tl.int64) * stride_g
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(split * tiles_per_split, tl.minimum((split + 1) * tiles_per_split, K // BLOCK_K)):
        group = tile * BLOCK_K // group_size  # BLOCK_K divides G: one group per tile
        p = tl.load(w_cols + tile * (BLOCK_K // 8) + words[None, :], mask=col_ok[:, None], other=0)
        p = tl.interleave(p, p)  # [BLOCK_N, BLOCK_K]: each word repeated 8 times along K, in
        p = tl.interleave(p, p)  # registers (one load per word)
        p = tl.interleave(p, p)
        z = tl.load(zeros_ptr + g_cols + group, mask=col_ok, other=0.0).to(tl.float32) + 8388608.0
        s = tl.load(scales_ptr + g_cols + group, mask=col_ok, other=0.0).to(tl.float32)
        w = ((_nibbles(p, shifts[None, :]) - z[:, None]) * s[:, None]).to(x_ptr.dtype.element_ty)
        xt = tl.load(x_rows + (tile * BLOCK_K + ks)[None, :], mask=(rows < M)[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(w), acc)
    store_tile(acc, out_ptr, bias_ptr, part_ptr, count_ptr, rows, cols, M, N, HAS_BIAS, SPLIT_K)


@triton.jit
def _int4_dequantize_kernel(w_ptr, zeros_ptr, scales_ptr, out_ptr, N, K, stride_w, stride_g, group_size,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """W [N, K] in out's dtype from the runtime layout, a [BLOCK_N, BLOCK_K] tile per program."""
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    words = tl.program_id(1) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    row_ok = (rows < N)[:, None]
    p = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + words[None, :], mask=row_ok & (words < K // 8)[None, :],
                other=0)
    p = tl.interleave(p, p)  # as in the GEMM: each word 8 times along K, so the stores are contiguous
    p = tl.interleave(p, p)
    p = tl.interleave(p, p)
    ok = row_ok & (ks < K)[None, :]
    g = rows.to(tl.int64)[:, None] * stride_g + (ks // group_size)[None, :]
    z = tl.load(zeros_ptr + g, mask=ok, other=0.0).to(tl.float32) + 8388608.0
    s = tl.load(scales_ptr + g, mask=ok, other=0.0).to(tl.float32)
    w = (_nibbles(p, ((ks % 8) * 4)[None, :]) - z) * s
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_int4_triton(weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """Triton version of `dequantize_int4`: W [N, K] in `dtype`."""
    out_features, words = weight.shape
    out = torch.empty(out_features, words * 8, dtype=dtype, device=weight.device)
    block_n, block_k = 32, 256
    pdl = programmatic_launch(weight)
    _int4_dequantize_kernel[(triton.cdiv(out_features, block_n), triton.cdiv(words * 8, block_k))](
        weight, zeros, scales, out, out_features, words * 8, weight.stride(0), zeros.stride(0), group_size,
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, **launch_options(pdl))
    return out


_TILE_COUNTS: dict[torch.device, torch.Tensor] = {}


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


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def split_k_for(rows: int, num_tiles: int, k_tiles: int, k: int, device: torch.device) -> tuple[int, int]:
    """(SPLIT_K, K tiles per split) for a grid of `num_tiles` output tiles over `k_tiles` K tiles:
    enough splits that about four programs run per SM, while the float32 partials (written and read
    back: 8 * SPLIT_K * rows bytes per column) stay under the weight bytes (k / 2 per column for int4,
    k for fp8, so k / 2 bounds both). Depends on shapes only, so a CUDA graph keeps it."""
    wanted = triton.cdiv(4 * _sm_count(device), num_tiles)
    split_k = max(1, min(wanted, k // (16 * rows), k_tiles, 32))
    per_split = triton.cdiv(k_tiles, split_k)
    return triton.cdiv(k_tiles, per_split), per_split


def gemv_split(tiles: int, words: int, block_w: int, device: torch.device) -> tuple[int, int]:
    """(SPLIT_K, words per split) of a one-row kernel over `tiles` row tiles and `words` K-words a
    row: a grid under four programs per SM is split along K to about eight (each split a whole
    number of BLOCK_W steps); larger grids are not split (the H200 sweep's best, Llama-3.2-1B shapes)."""
    sms = _sm_count(device)
    if tiles >= 4 * sms:
        return 1, words
    split = max(1, min(triton.cdiv(8 * sms, tiles), words // block_w, 32))
    per_split = triton.cdiv(triton.cdiv(words, split), block_w) * block_w
    return triton.cdiv(words, per_split), per_split


def matmul_config(rows: int) -> dict[str, int]:
    """Tile sizes of the dot kernels by batch rows: a few rows (decode: one 16-row tensor-core tile,
    split-K) or prefill (a tiled GEMM)."""
    if rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4)
    if rows <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


# The stream GEMV's tiling by weight size. A small weight (a few MB: Llama-3.2-1B's QKV and O) is
# latency-bound: 8 rows a program of 2 warps, 2,048 input features a step, so that its rows are read
# whole before the wait for the previous kernel. A large one (its gate/up and down) is bound by
# instruction issue: 16 rows a program of one warp, split along K when the rows leave SMs idle.
# H200, a CUDA graph of 16 calls, µs a call (8x256x2 / 8x256x4 / 16x64x1; rows x words x warps):
# QKV 3.28 / 3.54 / 4.39, O 2.65 / 2.64 / 3.38, gate/up 12.09 / 12.07 / 8.23, down 7.59 / 7.46 / 5.75
# (bench/quant_kernels.py --int4-one-row at 60359f0; the latency GEMV over [rows, groups, words]
# tiles it replaced, at 7959488: QKV 3.91, O 3.35). The FP8 one-row kernel's tilings split at the same size.
STREAM_WEIGHTS = 8 << 20


def stream_gemv_config(out_features: int, in_features: int, group_size: int) -> dict[str, int]:
    """_int4_stream_gemv_kernel's tiling for a weight [out_features, in_features] (STREAM_WEIGHTS):
    rows a program, words a step (whole groups; no wider than K for a small weight), warps."""
    if out_features * in_features < STREAM_WEIGHTS:
        words = min(256, triton.next_power_of_2(in_features // 8))
        return dict(ROWS=8, BLOCK_W=max(words, group_size // 8), num_warps=2, num_stages=1)
    return dict(ROWS=16, BLOCK_W=max(64, group_size // 8), num_warps=1, num_stages=1)


def _checked(weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, zeros, scales) contiguous, as repack_awq makes them, once their shapes and the group
    size are checked (ValueError)."""
    out_features, words = weight.shape
    in_features = words * 8
    if group_size < 16 or group_size & (group_size - 1) or in_features % group_size:
        raise ValueError(f"the group size ({group_size}) must be a power of two >= 16 dividing K ({in_features})")
    if zeros.shape != (out_features, in_features // group_size) or scales.shape != zeros.shape:
        raise ValueError(f"zeros {tuple(zeros.shape)} and scales {tuple(scales.shape)} must both be "
                         f"[N, K / G] = [{out_features}, {in_features // group_size}]")
    return weight.contiguous(), zeros.contiguous(), scales.contiguous()


def int4_linear_triton(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int, bias: torch.Tensor | None = None, silu_mul: bool = False,
                       norm_in: NormScale | None = None) -> torch.Tensor:
    """Triton version of `int4_linear_ref`, same contract (x [..., K] in fp32, fp16 or bf16); a
    norm_in's factor scales the one-row kernels' outputs (x itself, first, on the other paths)."""
    weight, zeros, scales = _checked(weight, zeros, scales, group_size)
    x2 = x.reshape(-1, weight.shape[1] * 8)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 1:
        out, _, _ = _one_row(x2, weight, zeros, scales, group_size, bias, silu_mul, norm_in, None)
    else:
        out = _int4_matmul(x2 if norm_in is None else norm_in.apply(x2), weight, zeros, scales, group_size, bias)
        if silu_mul:
            out = activation.silu_mul(out)
    return out.view(*x.shape[:-1], out.shape[-1])


def norm_arguments(out: torch.Tensor, tiles: int, norm_in: NormScale | None,
                   add_norm: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> tuple[tuple, torch.Tensor | None, torch.Tensor | None]:
    """A one-row kernel's norm arguments (in_sumsq, in_parts, eps, residual, norm_w, residual_out,
    sumsq; `out` stands in for those not read), and the add-norm outputs it writes (the new
    residual [1, N] and the float32 sums of squares, one per row tile), or None, None."""
    in_sumsq, in_parts, eps = (norm_in.sumsq, norm_in.sumsq.numel(), norm_in.eps) if norm_in else (out, 0, 0.0)
    if add_norm is None:
        return (in_sumsq, in_parts, eps, out, out, out, out), None, None
    residual_out = torch.empty_like(out)
    sumsq = torch.empty(tiles, dtype=torch.float32, device=out.device)
    args = (in_sumsq, in_parts, eps, add_norm[0].contiguous(), add_norm[1].contiguous(), residual_out, sumsq)
    return args, residual_out, sumsq


def _one_row(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             bias: torch.Tensor | None, silu_mul: bool, norm_in: NormScale | None,
             add_norm: tuple[torch.Tensor, torch.Tensor] | None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [1, K] through the stream GEMV, tiled by weight size (STREAM_WEIGHTS): out [1, N] ([1, N / 2]
    with silu_mul); with add_norm (residual [1, N], norm weight [N]), out is h * norm weight, and
    the new residual h and the sums of squares per row tile come too (else None, None)."""
    out_features, words = weight.shape
    in_features = words * 8
    cfg = stream_gemv_config(out_features, in_features, group_size)
    outputs = out_features // 2 if silu_mul else out_features
    tiles = triton.cdiv(outputs, cfg["ROWS"] // 2 if silu_mul else cfg["ROWS"])
    out = torch.empty(1, outputs, dtype=x.dtype, device=x.device)
    norm_args, residual_out, sumsq = norm_arguments(out, tiles, norm_in, add_norm)
    pdl = programmatic_launch(x)
    split_k, per_split = gemv_split(tiles, words, cfg["BLOCK_W"], x.device)
    part, counts = split_workspace(out, split_k, tiles, out_features)
    _int4_stream_gemv_kernel[(tiles, split_k)](
        x, weight, zeros, scales, bias, out, part, counts, out_features, in_features, weight.stride(0),
        zeros.stride(0), per_split, ONE_BITS, *norm_args, HAS_BIAS=bias is not None, GROUP=group_size,
        SPLIT_K=split_k, SILU_MUL=silu_mul, NORM_IN=norm_in is not None, ADD_NORM=add_norm is not None, PDL=pdl,
        **cfg, **launch_options(pdl))
    return out, residual_out, sumsq


def _int4_matmul(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T + bias → [M, N] for M > 1: the tile GEMM (up to GEMM_ROWS) or the weight
    dequantized once and cuBLAS (prefill)."""
    out_features, words = weight.shape
    in_features = words * 8
    rows = x.shape[0]
    if rows == 0:
        return x.new_empty(0, out_features)
    if rows > GEMM_ROWS:  # prefill: the weight once in x's dtype, then the tensor cores at full K depth
        w = dequantize_int4_triton(weight, zeros, scales, group_size, x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    pdl = programmatic_launch(x)
    cfg = matmul_config(rows)
    block_k = min(group_size, 64)
    num_tiles = triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(out_features, cfg["BLOCK_N"])
    split_k, per_split = split_k_for(rows, num_tiles, in_features // block_k, in_features, x.device)
    part, counts = split_workspace(out, split_k, num_tiles)
    _int4_matmul_kernel[(num_tiles, split_k)](
        x, weight, zeros, scales, bias, out, part, counts, rows, out_features, in_features, x.stride(0),
        weight.stride(0), zeros.stride(0), group_size, per_split,
        HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK_K=block_k, GROUP_M=8, IEEE=x.dtype == torch.float32,
        PDL=pdl, **cfg, **launch_options(pdl))
    return out


def int4_linear(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None, silu_mul: bool = False,
                norm_in: NormScale | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for W in the runtime layout (see repack_awq); with silu_mul, W is a merged
    gate/up weight and the result SiLU(gate) * up over y's two halves [..., N / 2] (in the one-row
    stream kernel's epilogue: a kernel less per decode layer). norm_in: x is one row still to be
    normalized (an add-norm epilogue's output), whose factor the one-row kernels apply to their
    outputs. Triton where `use_triton` says so, else the reference."""
    if use_triton(x):
        return int4_linear_triton(x, weight, zeros, scales, group_size, bias, silu_mul, norm_in)
    x = x if norm_in is None else norm_in.apply(x)
    return int4_linear_ref(x, weight, zeros, scales, group_size, bias, silu_mul)


def int4_linear_add_norm(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                         group_size: int, bias: torch.Tensor | None, residual: torch.Tensor,
                         norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, NormScale]:
    """y = x @ W.T + bias for one row x [1, K], then the residual add and RMSNorm that follow it, as
    kernels/rmsnorm.py's add_norm_ref: (y + residual) * norm_weight, the new residual y + residual,
    and the NormScale the next projection applies (int4_linear's norm_in). On the one-row kernels
    it is their epilogue: no norm kernel between two projections. Under PDL the kernel reads
    `residual` before waiting for the kernel before it, so that kernel must not be what wrote it
    (in the decoder an add-norm's residual comes from the add-norm two or more kernels back)."""
    if use_triton(x) and x.numel() == x.shape[-1]:
        out, h, sumsq = _one_row(x.reshape(1, -1).contiguous(), *_checked(weight, zeros, scales, group_size),
                                 group_size, bias, False, None, (residual.reshape(1, -1), norm_weight))
        return out.view(residual.shape), h.view(residual.shape), NormScale(sumsq, eps)
    return add_norm_ref(int4_linear(x, weight, zeros, scales, group_size, bias), residual, norm_weight, eps)
