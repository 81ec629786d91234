"""The end-to-end tuning: group scales and norm weights only, toward the float model's next tokens."""
from __future__ import annotations

import pytest
import torch

from engine.loader import load_model
from engine.quantization.calibration import calibration_sequences
from engine.quantization.gptq import int4_gptq_calibrate, int4_lm_head_calibrate
from engine.quantization.grid import quantize_weight
from engine.quantization.tuning import TUNE_HELD_OUT, _kl, _next_token_logprobs, tune_end_to_end, tuning_targets
from engine.tokenizer import Tokenizer
from kernels.int4_layout import unpack_awq
from tests.engine.quantization.conftest import CPU


@pytest.mark.slow
def test_end_to_end_tuning_keeps_the_levels_and_lowers_the_held_out_kl(tiny_with_tokenizer, monkeypatch) -> None:
    """The tuning moves only group scales (still float16 values) and norm weights: every weight stays
    (its level - its zero point) * its group's scale, with the levels and zero points GPTQ chose,
    and the next-token KL from the float model on the held-out end of the text goes down. With the
    Triton kernels on (the interpreter here, as a GPU would) it still differentiates: through the
    torch references."""
    teacher = load_model(tiny_with_tokenizer, torch.float32, CPU)
    model = load_model(tiny_with_tokenizer, torch.float32, CPU)
    sequences = calibration_sequences(Tokenizer.from_dir(tiny_with_tokenizer), 1024)
    grids = int4_gptq_calibrate(model, sequences, 32)
    head, grids[head] = int4_lm_head_calibrate(model, sequences, 32)  # --lm-head: tuned with the rest
    assert model.lm_head is head and model.embed_tokens.weight.data_ptr() != head.weight.data_ptr()
    levels = {m: torch.round(m.weight / s.repeat_interleave(32, 1)) for m, (s, _z) in grids.items()}
    zeros = {m: z.clone() for m, (_s, z) in grids.items()}
    head_scale = grids[head][0].clone()
    norm = model.norm.detach().clone()
    targets = tuning_targets(teacher, sequences)
    tokens = [t for seq in sequences for t in seq]
    held = [tokens[int(len(tokens) * (1 - TUNE_HELD_OUT)):]]
    assert targets.held == held and sum(map(len, targets.tune)) + len(held[0]) == len(tokens)

    def held_out_kl() -> float:
        with torch.no_grad():
            return _kl(_next_token_logprobs(teacher, held), _next_token_logprobs(model, held)).item()

    before = held_out_kl()
    tune_end_to_end(model, targets, grids, 32, steps=0)
    assert held_out_kl() == before
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tune_end_to_end(model, targets, grids, 32, steps=5)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert held_out_kl() < before
    assert not torch.equal(model.norm, norm) and not torch.equal(grids[head][0], head_scale)
    for module, (scale, zero) in grids.items():
        assert torch.equal(scale, scale.half().float()) and (scale > 0).all() and torch.equal(zero, zeros[module])
        step = scale.repeat_interleave(32, 1)
        assert torch.equal(module.weight, levels[module] * step)
        exported = quantize_weight(module.weight, 32, (scale, zero))
        assert torch.equal(unpack_awq(exported["qweight"]).t().float() - zero.repeat_interleave(32, 1), levels[module])
