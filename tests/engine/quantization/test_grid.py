"""The int4 grid: round-to-nearest within half a step of each group's grid, and the default group size."""
from __future__ import annotations

import torch

from engine.loader import load_model
from engine.models.config import ModelConfig
from engine.quantization import quantize_checkpoint
from engine.quantization.grid import default_group_size
from tests.engine.quantization.conftest import CPU


def test_rtn_weights_are_within_half_a_step(tiny_with_tokenizer, tmp_path) -> None:
    out = quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "q", "rtn", group_size=32)
    original, quantized = load_model(tiny_with_tokenizer, torch.float32, CPU), load_model(out, torch.float32, CPU)
    for a, b in zip(original.layers, quantized.layers):
        for linear in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            w, q = getattr(a, linear).weight, getattr(b, linear)
            step = q.weight_scales.float().repeat_interleave(32, dim=1)
            err = (q.dequantize().float() - w).abs()
            assert (err <= 0.5 * step + 2e-3 * w.abs() + 1e-6).all(), linear


def test_default_group_size_follows_the_source_blocks_where_they_fit(default_model_dir, tiny_model_dir) -> None:
    # SmolLM2 (hidden 576: 128 does not fit) was Q4_1 in blocks of 32; a Llama shape takes 128 unless
    # its weights came from such blocks; a block that does not fit the layers is passed over.
    smol = ModelConfig.from_dir(default_model_dir)
    assert default_group_size(smol) == 64 and default_group_size(smol, 32) == 32
    tiny = ModelConfig.from_dir(tiny_model_dir("tiny-llama3")[0])
    assert default_group_size(tiny) == 64 and default_group_size(tiny, 32) == 32 and default_group_size(tiny, 256) == 64
