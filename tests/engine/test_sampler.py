"""Sampler: greedy, bias, penalties, filters, the seeded hash noise, logprobs and batch invariance."""
from __future__ import annotations

import math
from typing import Sequence

import pytest
import torch

from engine.sampler import Sampler, SampleRow, apply_logit_bias, apply_penalties
from kernels.sampling import argmax_rows, gumbel_argmax_ref, gumbel_noise
from engine.sampling_params import SamplingParams

sampler = Sampler()


def row(seed: int = 0, counter: int = 0, prompt: Sequence[int] = (), output: Sequence[int] = (), **params) -> SampleRow:
    return SampleRow(SamplingParams(**params), seed, counter, list(prompt), list(output))


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    return [w / sum(weights) for w in weights]


def allowed_tokens(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens a filtered row may pick, computed in plain Python: min_p, then top_k, then top_p."""
    probs = softmax([x / temperature for x in logits])
    kept = [i for i, p in enumerate(probs) if p >= min_p * max(probs)]
    kept.sort(key=lambda i: -probs[i])
    if top_k > 0:
        kept = kept[:top_k]
    total = sum(probs[i] for i in kept)
    chosen, mass = [], 0.0
    for i in kept:
        chosen.append(i)
        mass += probs[i] / total
        if mass >= top_p:
            break
    return set(chosen)


def total_variation(tokens: torch.Tensor, probs: list[float]) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double() / len(tokens)
    return 0.5 * sum(abs(c - p) for c, p in zip(counts.tolist(), probs))


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = sampler(logits, [row(seed=i, temperature=0.0) for i in range(6)])
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("vocab", [49152, 1008, 97])
def test_argmax_rows_is_the_first_maximum(vocab: int) -> None:
    # Chunked (vocab divisible by 16 or more) and plain; ties across and inside chunks, and the
    # maximum in each chunk position, must give torch.argmax's first index.
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 50, (6, vocab), generator=g).float()
    scores[1, vocab - 1] = 99.0  # last element
    scores[2, 0] = 99.0  # first element
    scores[3, [5, vocab // 2, vocab - 3]] = 99.0  # ties in different chunks
    scores[4, [vocab // 2, vocab // 2 + 1]] = 99.0  # ties next to each other
    scores[5] = -3.0  # all equal
    assert torch.equal(argmax_rows(scores), scores.argmax(dim=-1))
    assert argmax_rows(scores)[5] == 0 and argmax_rows(scores)[1] == vocab - 1
    padded = torch.cat([scores, torch.full((6, 16), 1e9)], dim=1)[:, :vocab]  # a padded vocabulary's slice
    assert torch.equal(argmax_rows(padded), scores.argmax(dim=-1))


def test_greedy_logit_bias_flips_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]] * 3)
    rows = [row(temperature=0.0), row(temperature=0.0, logit_bias={1: -5.0}), row(temperature=0.0, logit_bias={3: 2.6})]
    assert sampler(logits, rows).token_ids.tolist() == [1, 2, 3]
    assert torch.equal(apply_logit_bias(logits, rows)[2], torch.tensor([1.0, 3.0, 2.0, 3.1]))


@pytest.mark.parametrize(
    "filters",
    [
        {"top_k": 3},
        {"top_p": 0.6},
        {"min_p": 0.2},
        {"top_k": 6, "top_p": 0.8, "min_p": 0.05},
        {"top_k": 1},
    ],
)
def test_filters_never_pick_outside_allowed_set(filters: dict) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 32, generator=gen) * 2.0
    temperature, draws = 0.8, 300
    rows = [row(seed=7 + r, counter=c, temperature=temperature, **filters) for r in range(4) for c in range(draws)]
    tokens = sampler(logits.repeat_interleave(draws, dim=0), rows).token_ids.view(4, draws)
    for r in range(4):
        allowed = allowed_tokens(logits[r].tolist(), temperature, filters.get("top_k", 0),
                                 filters.get("top_p", 1.0), filters.get("min_p", 0.0))
        seen = set(tokens[r].tolist())
        assert seen <= allowed, (r, seen - allowed)
        assert len(seen) > 1 or len(allowed) == 1  # it really sampled


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_distribution_matches_softmax(temperature: float) -> None:
    base = [2.0, 1.0, 0.5, 0.0, -0.5, 1.5, 0.2, -1.0]
    expected = softmax([x / temperature for x in base])
    draws = 20_000
    logits = torch.tensor([base]).expand(draws, -1)
    over_counters = sampler(logits, [row(seed=42, counter=c, temperature=temperature) for c in range(draws)])
    over_seeds = sampler(logits, [row(seed=s, counter=5, temperature=temperature) for s in range(draws)])
    assert total_variation(over_counters.token_ids, expected) < 0.02
    assert total_variation(over_seeds.token_ids, expected) < 0.02


def test_gumbel_noise_moments() -> None:
    noise = gumbel_noise(list(range(64)), [3] * 64, 4096, torch.device("cpu"))
    assert noise.isfinite().all()
    assert abs(noise.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(noise.var().item() - math.pi**2 / 6) < 0.03


def test_penalties_follow_the_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5, 1.0]] * 3)
    prompt, output = [1, 2], [2, 3, 3]
    rows = [
        row(prompt=prompt, output=output, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3),
        row(prompt=prompt, output=output),  # no penalties: untouched
        row(prompt=prompt, output=output, frequency_penalty=-0.4),
    ]
    got = apply_penalties(logits, rows)
    for r, sample in enumerate(rows):
        p = sample.params
        for token in range(6):
            x = logits[r, token].item()
            count = output.count(token)
            if token in prompt or count:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= count * p.frequency_penalty + (count > 0) * p.presence_penalty
            assert got[r, token].item() == pytest.approx(x, abs=1e-6), (r, token)
    assert got[0, 1].item() == pytest.approx(-1.5)  # prompt-only token, negative logit: multiplied
    assert got[0, 2].item() == pytest.approx(3.0 / 1.5 - 0.5 - 0.3)
    assert apply_penalties(logits, [row(), row(), row()]) is logits  # stage skipped


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.8]])
    assert sampler(logits, [row(prompt=[1], temperature=0.0, repetition_penalty=1.2)]).token_ids.tolist() == [2]
    assert sampler(logits, [row(output=[1], temperature=0.0, presence_penalty=0.3)]).token_ids.tolist() == [2]


def test_logprobs_come_from_raw_logits() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=gen)
    rows = [
        row(seed=1, temperature=0.3, logprobs=5, logit_bias={7: 10.0}),
        row(seed=2, logprobs=None, top_k=4),
        row(seed=3, temperature=0.0, logprobs=0, output=[0, 0, 1], repetition_penalty=2.0, frequency_penalty=1.0),
        row(seed=4, temperature=1.5, logprobs=20, top_p=0.5),
        row(seed=5, temperature=0.0, logprobs=2),
    ]
    out = sampler(logits, rows)
    reference = logits.log_softmax(dim=-1)
    assert out.logprobs[1] is None
    for r, sample in enumerate(rows):
        lp = out.logprobs[r]
        if sample.params.logprobs is None:
            continue
        assert lp is not None and lp.token_id == out.token_ids[r].item()
        assert lp.logprob == pytest.approx(reference[r, lp.token_id].item(), abs=1e-5)
        values, ids = reference[r].topk(sample.params.logprobs)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert out.token_ids[0].item() == 7 and out.logprobs[0].logprob < -1.0  # biased pick, raw logprob


def _others(counter: int) -> list[SampleRow]:
    """Seven rows of assorted params to surround the row under test."""
    return [
        row(seed=1, counter=counter, temperature=0.0),
        row(seed=2, counter=counter + 3, top_k=5, output=[1, 2, 2], frequency_penalty=1.0),
        row(seed=1234, counter=counter + 1, temperature=1.3),  # same seed, other counter
        row(seed=4, counter=counter, temperature=0.0, repetition_penalty=1.3, prompt=[0, 5]),
        row(seed=5, counter=counter, min_p=0.1, logprobs=3, logit_bias={3: 5.0}),
        row(seed=6, counter=counter, temperature=0.7, presence_penalty=-1.0, output=[9]),
        row(seed=7, counter=counter, top_p=0.3),
    ]


def test_seeded_row_ignores_its_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    counters = 50
    target_logits = torch.randn(counters, 64, generator=gen)
    other_logits = torch.randn(counters, 7, 64, generator=gen)

    def target(seed: int, counter: int) -> SampleRow:
        return row(seed=seed, counter=counter, temperature=0.9, top_p=0.95)

    alone = [sampler(target_logits[c : c + 1], [target(1234, c)]).token_ids.item() for c in range(counters)]
    for position in range(8):
        batched = []
        for c in range(counters):
            rows = _others(c)
            rows.insert(position, target(1234, c))
            logits = torch.cat([other_logits[c, :position], target_logits[c : c + 1], other_logits[c, position:]])
            batched.append(sampler(logits, rows).token_ids[position].item())
        assert batched == alone, position
    other_seed = [sampler(target_logits[c : c + 1], [target(1235, c)]).token_ids.item() for c in range(counters)]
    assert other_seed != alone
    assert len(set(alone)) > 5  # the counter really changes the draw


def test_any_integer_seed_is_accepted() -> None:
    logits = torch.zeros(4, 1000)
    rows = [row(seed=s, counter=9) for s in (0, -1, 2**63 + 5, 2**64 + 7)]
    tokens = sampler(logits, rows).token_ids.tolist()
    assert len(set(tokens)) == 4
    # Seeds count modulo 2**64: -1 and 2**64 - 1 are one seed.
    assert sampler(logits[:1], [row(seed=2**64 - 1, counter=9)]).token_ids.item() == tokens[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_batch_in_one_call(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(6, 100, generator=gen) * 3).to(dtype)
    rows = [
        row(seed=1, temperature=0.0, logprobs=2),
        row(seed=2, temperature=0.7, top_k=10, top_p=0.9),
        row(seed=3, temperature=0.0, output=[5, 5], frequency_penalty=2.0, presence_penalty=2.0),
        row(seed=4, min_p=0.05, logprobs=0, repetition_penalty=1.1, prompt=[1, 2, 3]),
        row(seed=5, temperature=1.0, logit_bias={42: 100.0}),
        row(seed=6, temperature=0.0),
    ]
    out = sampler(logits, rows)
    raw = logits.float()
    assert out.token_ids.shape == (6,) and out.token_ids.dtype == torch.int64
    assert out.token_ids[0].item() == raw[0].argmax().item()
    assert out.token_ids[2].item() == apply_penalties(raw[2:3], rows[2:3]).argmax().item()
    assert out.token_ids[4].item() == 42
    assert out.token_ids[5].item() == raw[5].argmax().item()
    assert out.token_ids[1].item() in set(raw[1].topk(10).indices.tolist())
    assert [lp is None for lp in out.logprobs] == [False, True, True, False, True, True]
    lp = out.logprobs[3]
    assert lp is not None and lp.top == []
    assert lp.logprob == pytest.approx(raw[3].log_softmax(-1)[lp.token_id].item(), abs=1e-5)


def test_plain_rows_are_drawn_as_the_sampler_would() -> None:
    """Sampler.draws hands a decode graph what it needs to draw plain rows (greedy, or a temperature
    alone) itself; drawn() then gives what __call__ would, logprobs included. Rows with bias,
    penalties or filters leave the draw to the sampler."""
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(3))
    plain = [row(seed=-2, counter=9, temperature=0.0, logprobs=2), row(seed=2**64 - 1, counter=9, temperature=0.7),
             row(seed=5, counter=3, temperature=1.3), row(seed=1 << 70, counter=1, temperature=1.0)]
    temperatures, seeds, counters = sampler.draws(plain, logits.shape[-1])
    assert temperatures == [0.0, 0.7, 1.3, 1.0] and counters == [9, 9, 3, 1]
    assert all(-(2**63) <= s < 2**63 for s in seeds)  # an int64 buffer holds them
    ids = gumbel_argmax_ref(logits, temperatures, seeds, counters)
    drawn, called = sampler.drawn(logits, ids, plain), sampler(logits, plain)
    assert torch.equal(drawn.token_ids, called.token_ids)
    assert drawn.logprobs[0].top == called.logprobs[0].top and drawn.logprobs[1:] == [None] * 3
    for params in ({"logit_bias": {3: 1.0}}, {"frequency_penalty": 0.5}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}):
        assert sampler.draws([*plain, row(temperature=0.7, **params)], logits.shape[-1]) is None
    assert sampler.draws([row(temperature=0.0, top_k=5)], 40) is not None  # filters do not touch greedy rows
