"""Seeded Gumbel noise for sampling: a counter-based hash, so each row's draw depends only on its
(seed, counter) and never on the rest of the batch. Candidate for a fused Triton kernel (hash, log,
argmax over the vocabulary in one pass); for now the torch reference runs on every device."""
from __future__ import annotations

from typing import Sequence, TypeVar

import torch

from kernels.dispatch import to_device

_MASK32 = 0xFFFFFFFF
# Round constants for the per-row keys; any distinct values do.
_KEY1, _KEY2 = 0x3C6EF372, 0x1B873593
_Int = TypeVar("_Int", int, torch.Tensor)


def _mix32(x: _Int) -> _Int:
    """A 32-bit xorshift-multiply hash (a bijection); works on Python ints and int64 tensors alike.

    Values stay in [0, 2**32) and both multipliers are < 2**31, so no int64 product overflows.
    """
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & _MASK32
    x = ((x ^ (x >> 15)) * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def _row_keys(seed: int, counter: int) -> tuple[int, int]:
    """Two 32-bit keys standing for (seed, counter): every bit of either input feeds both keys."""
    seed &= (1 << 64) - 1  # negative or huge seeds: use their low 64 bits
    key = _mix32(_mix32(_mix32((seed & _MASK32) ^ _KEY1) ^ (seed >> 32)) ^ (counter & _MASK32))
    return key, _mix32(key ^ _KEY2)


def gumbel_noise_ref(seeds: Sequence[int], counters: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32 standard Gumbel noise; entry (r, v) depends only on (seeds[r], counters[r], v)."""
    keys = to_device([_row_keys(s, c) for s, c in zip(seeds, counters)], torch.int64, device)
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=device)
    bits = _mix32(_mix32(vocab ^ keys[:, :1]) ^ keys[:, 1:])
    # 23 bits -> u = (2k + 1) / 2**24: exact in float32 and strictly inside (0, 1).
    u = ((bits >> 9) * 2 + 1).to(torch.float32) / float(1 << 24)
    return -torch.log(-torch.log(u))



def gumbel_noise(seeds: Sequence[int], counters: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Seeded Gumbel noise; dispatches to the best implementation for the device."""
    return gumbel_noise_ref(seeds, counters, vocab_size, device)
