"""Tensor parallelism's process group: this rank's place in it and the collectives the decoder needs.

One process per device joins the default torch.distributed group: NCCL on CUDA, gloo on CPU (the
same code path, which the CPU tests run). With one rank every collective is a no-op, so the decoder
calls them unconditionally.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("minillm.engine")

# NVLink multicast (NVLS) can take shared GPUs out of service; it stays off wherever ranks start.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# torch 2.13 renamed all_gather_into_tensor (the older name warns there); the GPU image has 2.11.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among `size` ranks that each hold a shard of every layer."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks, in place (row-parallel layers' partial outputs)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on each rank -> [rows, size * cols], rank 0's columns first (vocab shards)."""
        if self.size == 1:
            return x
        rows, cols = x.shape
        out = torch.empty(self.size * rows, cols, dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous())
        return out.view(self.size, rows, cols).permute(1, 0, 2).reshape(rows, self.size * cols)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place (sampled ids: only rank 0 samples)."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value: ranks agree on sizes each measured for itself."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


SINGLE = TensorParallel()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r uses GPU r; on CPU every rank uses the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_tensor_parallel(rank: int, size: int, device: torch.device, init_file: str,
                         timeout_s: float = 600.0) -> TensorParallel:
    """Join the group of `size` ranks that meet at init_file (a path all ranks can reach)."""
    if size == 1:
        return SINGLE
    os.environ.update(NO_MULTICAST)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    return TensorParallel(rank, size)


def close_tensor_parallel(tp: TensorParallel, timeout_s: float = 30.0) -> None:
    """Leave the group. NCCL's teardown is collective: every rank must call this at about the same
    time (a rank destroying alone waits for the others forever), so a rank that is gone is waited
    for only timeout_s, and the process exits without it."""
    if tp.size == 1 or not dist.is_initialized():
        return
    done = threading.Thread(target=dist.destroy_process_group, name="minillm-tp-close", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.warning("rank %d: the tensor-parallel group did not close in %.0f s; leaving it", tp.rank, timeout_s)
