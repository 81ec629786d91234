"""AWQ's scales: folded into the float model, they leave what it computes unchanged."""
from __future__ import annotations

import pytest
import torch

from engine.loader import load_model
from engine.packed_prefill import prompt_logits
from engine.quantization.awq import awq_calibrate
from tests.engine.quantization.conftest import CPU, PROMPT


@pytest.mark.parametrize("shape", ["tiny-llama3", "tiny-qwen2"])
def test_awq_scales_fold_into_the_float_model_exactly(tiny_model_dir, shape) -> None:
    # All heads their own KV head, so v_proj/o_proj get scales too (and Qwen2's v bias).
    path, _ = tiny_model_dir(shape, num_key_value_heads=4)
    model = load_model(path, torch.float32, CPU)
    before = prompt_logits(model, PROMPT)
    norms = model.layers[0].input_layernorm.clone()
    awq_calibrate(model, [list(range(3, 100)), list(range(200, 260))], group_size=32, clip=False)
    assert not torch.equal(norms, model.layers[0].input_layernorm)  # something was scaled
    torch.testing.assert_close(prompt_logits(model, PROMPT), before, rtol=1e-4, atol=1e-4)
