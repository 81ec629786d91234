"""The step's first kernel (kernels/embedding.py): placeholders resolved, embedding rows and the
first RMSNorm, against the torch reference, on CPU through Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from kernels.embedding import embed_rms_norm, embed_rms_norm_ref, resolve_placeholders
from tests.kernels.conftest import nan_poisoned_allocations


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 80])  # 80: a row that is not a power of two
@pytest.mark.parametrize("with_prev", [True, False], ids=["placeholders", "ids"])
def test_embed_rms_norm_matches_reference(triton_interpreter, dtype, hidden, with_prev) -> None:
    gen = torch.Generator().manual_seed(hidden)
    table = torch.randn(50, hidden, generator=gen).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    prev = torch.tensor([7, 41, 3], dtype=torch.int64) if with_prev else None
    ids = torch.tensor([-2, 5, -1, 49, -3, 0] if with_prev else [5, 49, 0], dtype=torch.int64)
    with nan_poisoned_allocations():
        out, rows = embed_rms_norm(ids, prev, table, norm_weight, 1e-6)
    ref_out, ref_rows = embed_rms_norm_ref(ids, prev, table, norm_weight, 1e-6)
    torch.testing.assert_close(rows, ref_rows, atol=0, rtol=0)  # the rows themselves: the next residual
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, ref_out, **tol)
    if with_prev:
        torch.testing.assert_close(rows[0], table[41])  # -2 names row 1 of the previous step's ids


def test_resolve_placeholders_takes_rows_of_the_previous_step() -> None:
    ids = torch.tensor([-1, 9, -3])
    assert resolve_placeholders(ids, torch.tensor([4, 5, 6])).tolist() == [4, 9, 6]
