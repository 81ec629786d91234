"""The fused Gumbel-max kernel against its torch reference, on CPU through Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from kernels.sampling import gumbel_argmax, gumbel_argmax_ref, gumbel_argmax_triton, int64_seeds

pytestmark = pytest.mark.usefixtures("triton_interpreter")


@pytest.mark.parametrize("vocab", [97, 1000, 5000])  # one block; one ragged chunk; five chunks
def test_gumbel_argmax_matches_the_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab + 3, generator=g)[:, :vocab]  # the sampler's strided slice of the logits
    temperatures = [0.0, 0.7, 1.0, 0.0, 1.3, 0.5, 2.0]
    # Seeds past int64 and negative ones: the kernel reads their low 64 bits, as the reference does.
    seeds = [0, 2**64 - 5, -3, 7, 2**63 + 11, 12345678901234, 1 << 70]
    counters = [5 + i for i in range(7)]
    out = gumbel_argmax(logits, temperatures, seeds, counters)
    assert torch.equal(out, gumbel_argmax_ref(logits, temperatures, seeds, counters))
    assert out[0] == logits[0].argmax() and out[3] == logits[3].argmax()
    # The noise moves sampled rows off their argmax somewhere, or the test would not see it.
    assert any(out[i] != logits[i].argmax() for i, t in enumerate(temperatures) if t > 0)


def test_gumbel_argmax_takes_the_first_maximum() -> None:
    scores = torch.zeros(3, 3000)
    scores[0, [2100, 40, 2999]] = 5.0  # ties in different chunks: the first
    scores[1, [1500, 1501]] = 1.0  # ties in one block
    scores[2] = float("-inf")  # every token masked: index 0, as torch.argmax
    out = gumbel_argmax(scores, [0.0] * 3, [0] * 3, [0] * 3)
    assert out.tolist() == [40, 1500, 0] == scores.argmax(dim=-1).tolist()


def test_gumbel_argmax_draws_depend_on_the_row_alone() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 2048, generator=g)
    counters = list(range(6))
    batch = gumbel_argmax(logits, [1.0] * 6, [7] * 6, counters)
    alone = [gumbel_argmax(logits[i : i + 1], [1.0], [7], [counters[i]]).item() for i in range(6)]
    assert batch.tolist() == alone
    assert len(set(batch.tolist())) > 1  # the counter changes the draw


def test_gumbel_argmax_takes_temperatures_as_float32_bits() -> None:
    """A decode graph passes its temperatures in its int64 input buffer, as float32 bit patterns."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(2))
    temperatures = [0.0, 0.7, 1.0, 1.9]
    seeds, counters = [3, -1, 2**64 - 1, 9], [9, 9, 10, 11]
    bits = torch.tensor(temperatures, dtype=torch.float32).view(torch.int32).to(torch.int64)
    args = torch.tensor(int64_seeds(seeds)), torch.tensor(counters)
    out = gumbel_argmax_triton(logits, bits, *args)
    assert torch.equal(out, gumbel_argmax_triton(logits, torch.tensor(temperatures), *args))
    assert torch.equal(out, gumbel_argmax_ref(logits, temperatures, seeds, counters))


def test_gumbel_argmax_also_writes_the_ids_into_a_host_row() -> None:
    # A decode graph's draw writes its ids into the host ring's row named by a device scalar too
    # (pinned memory on a GPU; a CPU tensor here), beside the rows it leaves alone.
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 1500, generator=g)
    host = torch.full((4, 5), -1, dtype=torch.int64)
    out = gumbel_argmax_triton(logits, torch.tensor([0.0, 0.7, 1.0]), torch.tensor(int64_seeds([1, 2, 3])),
                               torch.tensor([4, 5, 6]), host=(host, torch.tensor([2])))
    assert torch.equal(out, gumbel_argmax_ref(logits, [0.0, 0.7, 1.0], [1, 2, 3], [4, 5, 6]))
    assert host[2, :3].tolist() == out.tolist() and (host[2, 3:] == -1).all()
    assert (host[[0, 1, 3]] == -1).all()


def test_gumbel_argmax_reads_half_precision_logits_as_float32() -> None:
    """A decode graph hands the draw the model's own logits (bf16 on a GPU; fp16 here, which the
    interpreter computes right): the same ids as from the float32 copy the sampler would make."""
    logits = (4 * torch.randn(5, 3000 + 5, generator=torch.Generator().manual_seed(3))).half()[:, :3000]
    temperatures, seeds, counters = [0.0, 0.7, 1.0, 0.0, 1.6], [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    args = torch.tensor(temperatures), torch.tensor(int64_seeds(seeds)), torch.tensor(counters)
    out = gumbel_argmax_triton(logits, *args)
    assert torch.equal(out, gumbel_argmax_triton(logits.float(), *args))
    assert torch.equal(out, gumbel_argmax_ref(logits.float(), temperatures, seeds, counters))
