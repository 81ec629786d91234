"""Seeded Gumbel-max sampling: a counter-based hash, so each row's draw depends only on its
(seed, counter) and never on the rest of the batch.

`gumbel_argmax` picks a token per row in one pass over the vocabulary: the argmax of scores /
temperature + noise, or of the scores alone for greedy rows (temperature 0). On CUDA it is one
Triton kernel (hash, log and argmax fused; each row's vocabulary in chunks, the last chunk of a row
to finish reducing the others); elsewhere its torch reference, which materializes the [B, V] noise.
Both draw the same noise: the hash is integer arithmetic, and the floats are exact up to the two
logs, which both take from CUDA's libdevice (tests/gpu checks the tokens agree).
"""
from __future__ import annotations

from typing import Sequence, TypeVar

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.dispatch import sm_count, to_device, use_triton

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
# Round constants for the per-row keys; any distinct values do (_row_key spells them out too).
_KEY1, _KEY2 = 0x3C6EF372, 0x1B873593
_Int = TypeVar("_Int", int, torch.Tensor)


def _mix32(x: _Int) -> _Int:
    """A 32-bit xorshift-multiply hash (a bijection); works on Python ints and int64 tensors alike.

    Values stay in [0, 2**32) and both multipliers are < 2**31, so no int64 product overflows.
    """
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & _MASK32
    x = ((x ^ (x >> 15)) * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def row_key(seed: int, counter: int) -> tuple[int, int]:
    """A row's two 32-bit hash keys, standing for (seed, counter): every bit of either input feeds
    both keys (the kernel derives them itself: _row_key)."""
    seed &= _MASK64  # negative or huge seeds: use their low 64 bits
    key = _mix32(_mix32(_mix32((seed & _MASK32) ^ _KEY1) ^ (seed >> 32)) ^ (counter & _MASK32))
    return key, _mix32(key ^ _KEY2)


def gumbel_noise_ref(seeds: Sequence[int], counters: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32 standard Gumbel noise; entry (r, v) depends only on (seeds[r], counters[r], v)."""
    keys = to_device([row_key(s, c) for s, c in zip(seeds, counters)], torch.int64, device)
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=device)
    bits = _mix32(_mix32(vocab ^ keys[:, :1]) ^ keys[:, 1:])
    # 23 bits -> u = (2k + 1) / 2**24: exact in float32 and strictly inside (0, 1).
    u = ((bits >> 9) * 2 + 1).to(torch.float32) / float(1 << 24)
    return -torch.log(-torch.log(u))


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """scores.argmax(dim=-1) for [B, V] float scores, the first index of each row's maximum. A row is
    cut into up to 256 equal chunks first, on every device (same result, one code path): on a GPU
    torch reduces one row with one thread block, slow over a 128k vocabulary; two passes over chunks
    spread it over the SMs (docs/performance.md)."""
    rows, vocab = scores.shape
    chunks = next((c for c in (256, 128, 64, 32, 16) if vocab % c == 0), 1)
    if chunks == 1:
        return scores.argmax(dim=-1)
    best, within = scores.view(rows, chunks, vocab // chunks).max(dim=-1)  # each chunk's first maximum
    chunk = best.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    return (chunk * (vocab // chunks) + within.gather(1, chunk)).squeeze(1)


def gumbel_argmax_ref(scores: torch.Tensor, temperatures: Sequence[float], seeds: Sequence[int],
                      counters: Sequence[int]) -> torch.Tensor:
    """Torch reference of gumbel_argmax: greedy rows' argmax, the others' argmax of scores /
    temperature + their noise (materialized for those rows only)."""
    sampled = [i for i, t in enumerate(temperatures) if t > 0]
    if len(sampled) < len(temperatures):
        token_ids = argmax_rows(scores)
        if not sampled:
            return token_ids
        index = to_device(sampled, torch.int64, scores.device)
        token_ids[index] = gumbel_argmax_ref(scores[index], [temperatures[i] for i in sampled],
                                             [seeds[i] for i in sampled], [counters[i] for i in sampled])
        return token_ids
    divisor = to_device(list(temperatures), torch.float32, scores.device).reshape(-1, 1)
    return argmax_rows(scores / divisor + gumbel_noise_ref(seeds, counters, scores.shape[-1], scores.device))


@triton.jit
def _mix32_u32(x):
    """_mix32 in uint32 arithmetic (wrapping products): the same values as its int64 form."""
    x = (x ^ (x >> 16)) * 0x21F0AAAD
    x = (x ^ (x >> 15)) * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _row_key(seed, counter):
    """row_key on the device: seed an int64 (its 64 bits), counter an int64 (its low 32)."""
    seed = seed.to(tl.uint64, bitcast=True)
    low = (seed & 0xFFFFFFFF).to(tl.uint32)
    high = (seed >> 32).to(tl.uint32)
    key = _mix32_u32(_mix32_u32(_mix32_u32(low ^ 0x3C6EF372) ^ high) ^ counter.to(tl.uint32))
    return key, _mix32_u32(key ^ 0x1B873593)


@triton.jit
def _gumbel_argmax_kernel(scores_ptr, stride_row, temps_ptr, seeds_ptr, counters_ptr, part_val_ptr, part_idx_ptr,
                          count_ptr, out_ptr, host_ptr, host_slot_ptr, host_stride,
                          V, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr,
                          LIBDEVICE: tl.constexpr, HOST: tl.constexpr):
    """Program (row, chunk): the first maximum of its CHUNK scores (plus noise where the row
    samples); the row's last chunk to finish picks the first chunk holding the row's maximum.
    LIBDEVICE: the logs and the division of CUDA's libdevice, as torch's CUDA kernels (off in
    Triton's interpreter, which has only numpy's). HOST: the id also into row *host_slot_ptr of
    host_ptr, pinned host memory the GPU writes itself (no copy to the host after the kernel)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temps_ptr + row)
    if temps_ptr.dtype.element_ty != tl.float32:  # a decode graph's int64 input row: float32 bits
        temperature = temperature.to(tl.int32).to(tl.float32, bitcast=True)
    key1, key2 = _row_key(tl.load(seeds_ptr + row), tl.load(counters_ptr + row))
    begin = chunk * CHUNK
    end = tl.minimum(begin + CHUNK, V)
    best = float("-inf")
    best_index = begin
    offs = tl.arange(0, BLOCK)
    for start in range(begin, end, BLOCK):
        v = start + offs
        ok = v < end
        # A decode graph hands over the model's bf16 logits: read as float32 (exact), as a cast before would.
        x = tl.load(scores_ptr + row.to(tl.int64) * stride_row + v, mask=ok, other=float("-inf")).to(tl.float32)
        if temperature > 0:
            bits = _mix32_u32(_mix32_u32(v.to(tl.uint32) ^ key1) ^ key2)
            u = ((bits >> 9) * 2 + 1).to(tl.float32) / 16777216.0  # exact: a power of two
            if LIBDEVICE:
                x = libdevice.div_rn(x, temperature) - libdevice.log(-libdevice.log(u))
            else:
                x = tl.div_rn(x, temperature) - tl.log(-tl.log(u))
            x = tl.where(ok, x, float("-inf"))
        block_best = tl.max(x, axis=0)
        if block_best > best:  # strictly: an equal maximum further on is not the first
            best = block_best
            best_index = start + tl.argmax(x, axis=0, tie_break_left=True)
    tl.store(part_val_ptr + row * CHUNKS + chunk, best)
    tl.store(part_idx_ptr + row * CHUNKS + chunk, best_index)
    tl.debug_barrier()  # this program's partial is stored before the count says so
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
    if arrived == CHUNKS - 1:
        chunks = tl.arange(0, CHUNKS_PAD)
        values = tl.load(part_val_ptr + row * CHUNKS + chunks, mask=chunks < CHUNKS, other=float("-inf"),
                         cache_modifier=".cg")
        first = tl.argmax(values, axis=0, tie_break_left=True)
        token = tl.load(part_idx_ptr + row * CHUNKS + first, cache_modifier=".cg")
        tl.store(out_ptr + row, token)
        if HOST:
            tl.store(host_ptr + tl.load(host_slot_ptr) * host_stride + row, token)
        tl.store(count_ptr + row, 0)


_COUNTS: dict[torch.device, torch.Tensor] = {}  # per device: each row's arrived chunks, zero between calls


def gumbel_argmax_triton(scores: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                         out: torch.Tensor | None = None,
                         host: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """gumbel_argmax from device tensors (no host data: a CUDA graph may capture it): scores float32
    or the model's bf16 / fp16 logits (read as float32), temperatures [B] float32 (or int64 holding
    float32 bits), seeds [B] int64 (int64_seeds) and counters [B] int64; the ids into `out` (int64
    [B]) if given, and with `host` (pinned int64 [slots, >= B], a device int64 slot index) into
    that row of the host tensor too. The per-row arrival counters are made on a first call, which
    precedes any capture (graphs are warmed up first)."""
    rows, vocab = scores.shape
    device = scores.device
    # About eight programs per SM over the batch (each loads a 4 KB block at a time), each at least
    # 1,024 scores.
    chunks = max(1, min(triton.cdiv(vocab, 1024), triton.cdiv(8 * sm_count(device), rows), 128))
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), 1024) * 1024
    chunks = triton.cdiv(vocab, chunk)
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < rows:  # 64k rows: never outgrown once a graph holds them
        counts = _COUNTS[device] = torch.zeros(max(rows, 1 << 16), dtype=torch.int32, device=device)
    part_val = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    part_idx = torch.empty(rows, chunks, dtype=torch.int64, device=device)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=device)
    host_ids, host_slot = host if host is not None else (out, out)
    _gumbel_argmax_kernel[(rows, chunks)](
        scores, scores.stride(0), temperatures, seeds, counters, part_val, part_idx, counts, out, host_ids, host_slot,
        host_ids.stride(0), vocab, CHUNK=chunk, CHUNKS=chunks, CHUNKS_PAD=max(triton.next_power_of_2(chunks), 2),
        BLOCK=1024, LIBDEVICE=scores.is_cuda, HOST=host is not None, num_warps=4)
    return out


def int64_seeds(seeds: Sequence[int]) -> list[int]:
    """Seeds as int64 values with the same low 64 bits (what row_key reads of any seed)."""
    return [(s & _MASK64) - (1 << 64) if s & (1 << 63) else s & _MASK64 for s in seeds]


def gumbel_argmax(scores: torch.Tensor, temperatures: Sequence[float], seeds: Sequence[int], counters: Sequence[int]
                  ) -> torch.Tensor:
    """Token ids [B] int64 from float32 scores [B, V] (rows may be strided, columns contiguous): per
    row the argmax of scores / temperature + the Gumbel noise of its (seed, counter), or of the
    scores alone where its temperature is 0. Triton where it runs, else gumbel_argmax_ref."""
    if not use_triton(scores) or scores.shape[0] == 0 or scores.stride(-1) != 1:
        return gumbel_argmax_ref(scores, temperatures, seeds, counters)
    device = scores.device
    return gumbel_argmax_triton(scores, to_device([float(t) for t in temperatures], torch.float32, device),
                                to_device(int64_seeds(seeds), torch.int64, device),
                                to_device(list(counters), torch.int64, device))


def gumbel_noise(seeds: Sequence[int], counters: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Seeded Gumbel noise [B, V] (the draw gumbel_argmax adds, materialized: tests and references)."""
    return gumbel_noise_ref(seeds, counters, vocab_size, device)
