"""The step's first kernel (kernels/embedding.py) against its torch reference on a CUDA GPU, at the
Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B hidden sizes, outputs poisoned (run through the device
tool; skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.embedding import embed_rms_norm, embed_rms_norm_ref
from tests.gpu.test_kernels_cuda import rel_err
from tests.kernels.conftest import nan_poisoned_allocations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [896, 2048, 4096])
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_embed_rms_norm(dtype, hidden, tokens) -> None:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    table = torch.randn(32000, hidden, device="cuda", dtype=dtype, generator=gen)
    norm_weight = 1 + 0.1 * torch.randn(hidden, device="cuda", dtype=dtype, generator=gen)
    prev = torch.randint(0, 32000, (16,), device="cuda", generator=gen)
    ids = torch.randint(-16, 32000, (tokens,), device="cuda", generator=gen)  # negative: placeholders
    with nan_poisoned_allocations():
        out, rows = embed_rms_norm(ids, prev, table, norm_weight, 1e-5)
    ref_out, ref_rows = embed_rms_norm_ref(ids, prev, table, norm_weight, 1e-5)
    assert torch.equal(rows, ref_rows)
    assert rel_err(out, ref_out) < 1e-2
