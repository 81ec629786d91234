"""A decode graph's inputs, read by its first kernel from a ring of pinned host rows.

The host writes step k's inputs into row k % rows (its first entry the number that follow) and
launches the graph; the graph's first kernel copies that row into the graph's static buffer, notes
the row consumed, and counts k on. So no host-to-device copy precedes the graph: the copy engine's
start, and the device's wait for it, cost more than the few bytes it carries.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import use_triton


def stage_ref(ring: torch.Tensor, counter: torch.Tensor, consumed: torch.Tensor, dst: torch.Tensor) -> None:
    """Torch reference: row counter % rows of `ring` (int32 [rows, width]: a count n, then n values)
    into dst[:n]; consumed[row] = counter (int64 [rows]); counter (int64 [1]) += 1."""
    step = int(counter[0])
    row = step % ring.shape[0]
    n = int(ring[row, 0])
    dst[:n] = ring[row, 1: 1 + n].to(dst.device)
    consumed[row] = step
    counter += 1


@triton.jit
def _stage_kernel(ring_ptr, counter_ptr, consumed_ptr, dst_ptr, width, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # One program: the row's first BLOCK entries are read with its count (one trip to host memory
    # at a few rows), the rest in further blocks. Volatile: host memory the host rewrites.
    step = tl.load(counter_ptr)
    src = ring_ptr + (step % ROWS) * width
    offs = tl.arange(0, BLOCK)
    head = tl.load(src + offs, mask=offs < width, other=0, volatile=True)
    n = tl.sum(tl.where(offs == 0, head, 0))
    # head[i] is entry i - 1 of the values: shift by storing at offs - 1.
    tl.store(dst_ptr + offs - 1, head, mask=(offs >= 1) & (offs <= n))
    for start in range(BLOCK - 1, n, BLOCK):
        cols = start + offs
        mask = cols < n
        tl.store(dst_ptr + cols, tl.load(src + 1 + cols, mask=mask, volatile=True), mask=mask)
    tl.store(consumed_ptr + step % ROWS, step)
    tl.store(counter_ptr, step + 1)


def stage(ring: torch.Tensor, counter: torch.Tensor, consumed: torch.Tensor, dst: torch.Tensor) -> None:
    """stage_ref's copy as one Triton program where use_triton says so (a CUDA graph may capture it:
    the row comes from `counter`, on the device). `ring` and `consumed` are pinned host memory on
    CUDA, which the kernel reads and writes itself."""
    if not use_triton(dst):
        stage_ref(ring, counter, consumed, dst)
        return
    _stage_kernel[(1,)](ring, counter, consumed, dst, ring.stride(0), ROWS=ring.shape[0], BLOCK=1024, num_warps=4)


def maps_pinned_memory(device: torch.device) -> bool:
    """Whether Triton kernels on `device` read and write pinned host memory here (tried once, by
    `stage` copying a host row and noting it consumed on the host): a platform without mapped
    pinned memory copies instead."""
    try:
        ring = torch.tensor([[1, 7]], dtype=torch.int32, pin_memory=True)
        consumed = torch.full((1,), -1, dtype=torch.int64, pin_memory=True)
        dst = torch.zeros(1, dtype=torch.int32, device=device)
        stage(ring, torch.zeros(1, dtype=torch.int64, device=device), consumed, dst)
        torch.cuda.synchronize(device)
        return dst.item() == 7 and consumed.item() == 0
    except (RuntimeError, ValueError):
        return False
