"""The grammar-mask kernel against its torch reference, on CPU through Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from kernels.token_mask import apply_token_mask_ref, apply_token_mask_triton
from tests.kernels.conftest import nan_poisoned_allocations

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def random_bitmask(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    words = (vocab + 31) // 32
    bits = torch.randint(0, 2, (rows, words * 32), generator=generator, dtype=torch.int64)
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return packed.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else packed.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [31, 100, 2048 + 45])  # a partial word; several blocks with a ragged end
def test_token_mask_matches_the_reference(dtype: torch.dtype, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    padded = torch.randn(4, vocab + 7, generator=g).to(dtype)
    logits = padded[:, :vocab]  # a view with the padded row stride, as the sampler's slice of the lm_head
    bitmask = random_bitmask(6, vocab, g)  # more rows than the logits: the worker's buffer
    bitmask[0] = -1  # a row without a grammar: every token allowed
    with nan_poisoned_allocations():
        out = apply_token_mask_triton(logits, bitmask)
    ref = apply_token_mask_ref(logits, bitmask[:4])
    assert out.dtype == torch.float32  # the sampler's scores: the mask is its copy to float32
    assert torch.equal(out, ref)
    assert torch.equal(out[0], logits[0].float())
    assert bool(torch.isinf(out[1:]).any()) and bool((out == logits.float()).any())  # both kinds of token occur
