"""The checkpoints `minillm quantize` writes (AutoAWQ int4, with or without lm_head; compressed-tensors
FP8): their tensors and quantization_config, loaded back and generating."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engine.loader import load_model
from engine.models.config import QuantConfig, parse_quantization
from engine.models.linear import Fp8Linear, Int4Linear
from engine.packed_prefill import prompt_logits
from engine.quantization import quantize_checkpoint
from kernels.fp8_linear import FP8, FP8_MAX
from tests.engine.quantization.conftest import CPU, PROMPT, greedy, rel_err

# awq runs the whole pipeline, end-to-end tuning included, for TUNE_STEPS: up to its one held-out
# check. What the tuning does is test_tuning.py's; its default 40 steps (early-stopped at ~15) would
# triple these tests' time for the same checks.
INT4_METHODS = ["rtn", pytest.param("awq", marks=pytest.mark.slow)]
TUNE_STEPS = 5


@pytest.mark.parametrize("method", INT4_METHODS)
def test_quantized_directory_loads_back_and_generates(tiny_with_tokenizer, tmp_path, method) -> None:
    out = quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "q", method, group_size=32, calibration_tokens=256,
                              tune_steps=TUNE_STEPS)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
                  "modules_to_not_convert": None}
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.1.self_attn.k_proj.qweight"].shape == (64, 32 // 8)
    assert tensors["model.layers.1.mlp.down_proj.scales"].shape == (128 // 32, 64)
    assert tensors["model.layers.1.mlp.down_proj.scales"].dtype == torch.float16
    import transformers  # its config parser takes the directory for an AutoAWQ checkpoint

    assert transformers.AutoConfig.from_pretrained(out).quantization_config["quant_method"] == "awq"
    quantized = load_model(out, torch.float32, CPU)
    qkv = quantized.layers[0].qkv_proj
    assert isinstance(qkv, Int4Linear) and qkv.weight.shape == (qkv.out_features, 64 // 8)  # repacked, N-major
    assert not any(name.endswith(("qweight", "qzeros")) for name, _ in quantized.named_parameters())  # one copy
    assert len(greedy(out)) == 8
    # Random tiny weights amplify any error (a real model's is far smaller): a sanity bound only.
    reference = prompt_logits(load_model(tiny_with_tokenizer, torch.float32, CPU), PROMPT)
    assert rel_err(prompt_logits(quantized, PROMPT), reference) < 0.6


@pytest.mark.parametrize("method", INT4_METHODS)
def test_int4_lm_head_checkpoint(tiny_with_tokenizer, tmp_path, method) -> None:
    """--lm-head: lm_head int4 as well (tied here: the embedding stays float16), loaded as an
    Int4Linear whose dequantized weight gives the logits, within the layers' error of the float model."""
    plain = quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "p", method, group_size=32, calibration_tokens=256,
                                tune_steps=TUNE_STEPS)
    out = quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "q", method, group_size=32, calibration_tokens=256,
                              lm_head=True, tune_steps=TUNE_STEPS)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["lm_head"] is True and "lm_head" not in json.loads((plain / "config.json").read_text())["quantization_config"]
    tensors, plain_tensors = load_file(out / "model.safetensors"), load_file(plain / "model.safetensors")
    assert tensors["lm_head.qweight"].shape == (64, 49152 // 8) and tensors["lm_head.scales"].shape == (2, 49152)
    assert torch.equal(tensors["model.embed_tokens.weight"], plain_tensors["model.embed_tokens.weight"])
    assert set(tensors) - set(plain_tensors) == {"lm_head.qweight", "lm_head.qzeros", "lm_head.scales"}
    model, original = load_model(out, torch.float32, CPU), load_model(tiny_with_tokenizer, torch.float32, CPU)
    assert isinstance(model.lm_head, Int4Linear)
    head = model.lm_head.dequantize().float()
    step = model.lm_head.weight_scales.float().repeat_interleave(32, dim=1)
    err = (head - original.embed_tokens.weight).abs()
    if method == "rtn":  # to nearest; awq clips and GPTQ moves weights by more, for a lower output error
        assert (err <= 0.5 * step + 2e-3 * original.embed_tokens.weight.abs() + 1e-6).all()  # fp16 scales
    assert err.mean() < 0.5 * step.mean()
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ head.t(), rtol=1e-4, atol=1e-4)
    assert len(greedy(out)) == 8
    reference = prompt_logits(original, PROMPT)
    assert rel_err(prompt_logits(model, PROMPT), reference) < 0.6


def test_int4_lm_head_of_an_untied_model(tiny_model_dir, tmp_path) -> None:
    path, _ = tiny_model_dir("tiny-llama3", tie_word_embeddings=False)
    out = quantize_checkpoint(str(path), tmp_path / "q", "rtn", group_size=32, lm_head=True)
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    model, original = load_model(out, torch.float32, CPU), load_model(path, torch.float32, CPU)
    step = model.lm_head.weight_scales.float().repeat_interleave(32, dim=1)
    w = original.lm_head.weight
    assert ((model.lm_head.dequantize().float() - w).abs() <= 0.5 * step + 2e-3 * w.abs() + 1e-6).all()


def test_fp8_gptq_checkpoint_loads_back(tiny_with_tokenizer, tmp_path) -> None:
    out = quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "q", "fp8-gptq", calibration_tokens=256)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert parse_quantization(qc) == QuantConfig("fp8")
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    tensors = load_file(out / "model.safetensors")
    k_proj = tensors["model.layers.1.self_attn.k_proj.weight"]
    assert k_proj.dtype == FP8 and k_proj.shape == (32, 64)
    assert tensors["model.layers.1.self_attn.k_proj.weight_scale"].shape == (32, 1)
    # Each row keeps its largest magnitude's scale: the row's largest FP8 value is at or near 448.
    assert (k_proj.float().abs().amax(1) >= 0.8 * FP8_MAX).all()
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    quantized = load_model(out, torch.float32, CPU)
    assert isinstance(quantized.layers[0].qkv_proj, Fp8Linear)
    assert len(greedy(out)) == 8
    reference = prompt_logits(load_model(tiny_with_tokenizer, torch.float32, CPU), PROMPT)
    assert rel_err(prompt_logits(quantized, PROMPT), reference) < 0.2
