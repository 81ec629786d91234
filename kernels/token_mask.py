"""Grammar masks on the logits: -inf wherever a row's token bitmask (xgrammar's layout) has the
token's bit clear, as float32 scores: it is the sampler's copy of the logits to float32 too. One
kernel in place of the reference's chain of elementwise ops: at batch 64 the host's launches, not
the device, are what a constrained step pays for."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import use_triton


def apply_token_mask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Torch reference (float32, out of place): bit v of `bitmask[r]` (int32 words, [B, ceil(V / 32)],
    on the logits' device) set means row r may take token v."""
    vocab = logits.shape[1]
    # One AND with each bit's word (bit 31's is negative in int32): a third cheaper on a CPU than shifting.
    bits = torch.ones(32, dtype=torch.int32, device=logits.device) << torch.arange(32, dtype=torch.int32,
                                                                                   device=logits.device)
    allowed = (bitmask.unsqueeze(-1) & bits).ne(0).flatten(1)[:, :vocab]
    return logits.float().masked_fill(~allowed, float("-inf"))


@triton.jit
def _token_mask_kernel(logits_ptr, bitmask_ptr, out_ptr, vocab, words, logits_stride, BLOCK: tl.constexpr):
    # Grid: (rows, vocabulary blocks); each program reads BLOCK // 32 words of its row's bitmask.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    word = tl.load(bitmask_ptr + row * words + cols // 32, mask=inside, other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0
    logits = tl.load(logits_ptr + row * logits_stride + cols, mask=inside, other=0.0)
    out = tl.where(allowed, logits.to(tl.float32), float("-inf"))
    tl.store(out_ptr + row * vocab + cols, out, mask=inside)


def apply_token_mask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Triton version of `apply_token_mask_ref`."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and bitmask.is_contiguous() and bitmask.shape[0] >= rows
    assert bitmask.shape[1] * 32 >= vocab, "the bitmask covers fewer tokens than the logits"
    out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    block = 1024
    _token_mask_kernel[(rows, triton.cdiv(vocab, block))](logits, bitmask, out, vocab, bitmask.shape[1],
                                                          logits.stride(0), BLOCK=block)
    return out


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The grammar masks on the logits; Triton where `use_triton` says so, else the torch reference."""
    if use_triton(logits):
        return apply_token_mask_triton(logits, bitmask)
    return apply_token_mask_ref(logits, bitmask)
