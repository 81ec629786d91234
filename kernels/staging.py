"""A decode graph's inputs, read by its first kernel from a ring of pinned host rows.

The host writes step k's inputs into row k % rows, headed by k and the graph they are for, and
launches the graph; the graph's first kernel reads the row its step counter names, copies it into
the graph's static buffer if it is that step's and that graph's, notes the row consumed and counts
on. So no host-to-device copy precedes the graph: the copy engine's start, and the device's wait for
it, cost more than the few bytes it carries. A graph replayed with no row written for it (a
benchmark replaying it alone) finds none, and runs on the inputs it has, without counting.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import use_triton

HEAD = 3  # a row's step (mod 2**31), graph key and count of values, then the values
_STEP_MASK = (1 << 31) - 1


def stage_ref(ring: torch.Tensor, counter: torch.Tensor, consumed: torch.Tensor, dst: torch.Tensor, key: int) -> None:
    """Torch reference: if row counter % rows of `ring` (int32 [rows, width]) is headed by the
    counter's step and `key`, its n values into dst[:n], consumed[row] = counter (int64 [rows]) and
    counter (int64 [1]) += 1; else nothing."""
    step = int(counter[0])
    row = step % ring.shape[0]
    gen, row_key, n = ring[row, :HEAD].tolist()
    if gen != step & _STEP_MASK or row_key != key:
        return
    dst[:n] = ring[row, HEAD: HEAD + n].to(dst.device)
    consumed[row] = step
    counter += 1


@triton.jit
def _stage_kernel(ring_ptr, counter_ptr, consumed_ptr, dst_ptr, width, key, ROWS: tl.constexpr, HEAD: tl.constexpr,
                  BLOCK: tl.constexpr):
    # One program: the row's first BLOCK entries are read with its head (one trip to host memory at
    # a few rows), the rest in further blocks. Volatile: host memory the host rewrites.
    step = tl.load(counter_ptr)
    src = ring_ptr + (step % ROWS) * width
    offs = tl.arange(0, BLOCK)
    head = tl.load(src + offs, mask=offs < width, other=0, volatile=True)
    gen = tl.sum(tl.where(offs == 0, head, 0))
    row_key = tl.sum(tl.where(offs == 1, head, 0))
    ours = (gen == (step & 2147483647).to(tl.int32)) & (row_key == key)
    n = tl.where(ours, tl.sum(tl.where(offs == 2, head, 0)), 0)
    # head[i] is value i - HEAD: stored shifted.
    tl.store(dst_ptr + offs - HEAD, head, mask=(offs >= HEAD) & (offs < HEAD + n))
    for start in range(BLOCK - HEAD, n, BLOCK):
        cols = start + offs
        mask = cols < n
        tl.store(dst_ptr + cols, tl.load(src + HEAD + cols, mask=mask, volatile=True), mask=mask)
    if ours:
        tl.store(consumed_ptr + step % ROWS, step)
        tl.store(counter_ptr, step + 1)


def stage(ring: torch.Tensor, counter: torch.Tensor, consumed: torch.Tensor, dst: torch.Tensor, key: int) -> None:
    """stage_ref's copy as one Triton program where use_triton says so (a CUDA graph may capture it:
    the row comes from `counter`, on the device). `ring` and `consumed` are pinned host memory on
    CUDA, which the kernel reads and writes itself."""
    if not use_triton(dst):
        stage_ref(ring, counter, consumed, dst, key)
        return
    _stage_kernel[(1,)](ring, counter, consumed, dst, ring.stride(0), key, ROWS=ring.shape[0], HEAD=HEAD, BLOCK=1024,
                        num_warps=4)


def maps_pinned_memory(device: torch.device) -> bool:
    """Whether Triton kernels on `device` read and write pinned host memory here (tried once, by
    `stage` copying a host row and noting it consumed on the host): a platform without mapped
    pinned memory copies instead."""
    try:
        ring = torch.tensor([[0, 1, 1, 7]], dtype=torch.int32, pin_memory=True)
        consumed = torch.full((1,), -1, dtype=torch.int64, pin_memory=True)
        dst = torch.zeros(1, dtype=torch.int32, device=device)
        stage(ring, torch.zeros(1, dtype=torch.int64, device=device), consumed, dst, 1)
        torch.cuda.synchronize(device)
        return dst.item() == 7 and consumed.item() == 0
    except (RuntimeError, ValueError):
        return False
