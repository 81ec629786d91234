"""Serving quantized checkpoints, the other side of what this package writes: hand-built AWQ and FP8
checkpoints load into the merged projections, FP8 at load time, the folded norms of the one-row
kernels, and clear errors for quantization configs minillm cannot serve."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.distributed import TensorParallel
from engine.errors import ModelLoadError
from engine.llm_engine import LLMEngine
from engine.loader import layer_projections, load_model
from engine.models.config import ModelConfig, QuantConfig
from engine.models.linear import Fp8Linear
from engine.models.llama import DecoderModel
from engine.packed_prefill import prompt_logits
from engine.quantization import quantize_checkpoint
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from kernels.dispatch import unfolded_norms
from kernels.fp8_linear import FP8, FP8_MAX
from tests.engine.quantization.conftest import CPU, PROMPT, _float_and_awq_by_hand, greedy, rel_err


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of positions whose top-1 token two logits tensors agree on."""
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("kernel", ["int4-small-tiling", "int4-large-tiling", "fp8"])
def test_batch1_decode_folds_the_norms_into_the_quantized_projections(tiny_with_tokenizer, tmp_path, triton_interpreter,
                                                                      monkeypatch, kernel) -> None:
    """One token through an int4 or FP8 model runs 1 norm kernel, not 2L (the first is the embedding
    kernel's, the rest the one-row kernels' add-norm epilogues and scaled outputs), and gives the
    logits of the unfolded path."""
    import kernels.rmsnorm as rmsnorm
    import kernels.split_k as split_k

    large = kernel == "int4-large-tiling"
    if kernel == "fp8":
        model = load_model(tiny_with_tokenizer, torch.float32, CPU, quantization="fp8")
    else:
        model = load_model(quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "q", "rtn", group_size=32),
                           torch.float32, CPU)
    if large:  # the tiny weights would all take the small weights' tiling
        monkeypatch.setattr(split_k, "LARGE_TILING_MIN_WEIGHTS", 0)
    calls = []
    norm_kernel = rmsnorm.rms_norm_triton
    monkeypatch.setattr(rmsnorm, "rms_norm_triton", lambda *a, **k: calls.append(1) or norm_kernel(*a, **k))
    folded = prompt_logits(model, PROMPT[:1])
    assert len(calls) == 1
    with unfolded_norms():
        apart = prompt_logits(model, PROMPT[:1])
    assert len(calls) == 1 + 2 * model.cfg.num_layers
    # The stream kernel's float32 sums keep ~2**-20 of sum |x| (tests/kernels), which these random
    # weights' cancellations make ~1e-5 of the logits; FP8's products are exact in float32.
    assert rel_err(folded, apart) < (1e-6 if kernel == "fp8" else 1e-4)


def test_int4_lm_head_is_one_gpu_only(tiny_model_dir) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir("tiny-llama3")[0])
    with torch.device("meta"), pytest.raises(ModelLoadError, match="one GPU only"):
        DecoderModel(cfg, torch.float32, QuantConfig("awq", 32, lm_head=True), TensorParallel(rank=0, size=2))


@pytest.mark.parametrize("shape", ["tiny-llama3", "tiny-qwen2"])
def test_hand_built_awq_checkpoint_fills_the_merged_slices(tiny_model_dir, tmp_path, shape) -> None:
    float_dir, awq_dir = _float_and_awq_by_hand(tiny_model_dir(shape)[0], tmp_path)
    floats, awq = load_model(float_dir, torch.float32, CPU), load_model(awq_dir, torch.float32, CPU)
    for a, b in zip(floats.layers, awq.layers):
        for name, (module, start, size) in layer_projections(floats.cfg, a).items():
            q = layer_projections(awq.cfg, b)[name][0]
            deq = q.dequantize().float()
            torch.testing.assert_close(deq[start:start + size], module.weight[start:start + size], msg=name)
            if module.bias is not None:
                torch.testing.assert_close(q.bias[start:start + size], module.bias[start:start + size])
    torch.testing.assert_close(prompt_logits(awq, PROMPT), prompt_logits(floats, PROMPT), rtol=1e-4, atol=1e-4)
    assert greedy(awq_dir) == greedy(float_dir)


@pytest.mark.slow  # the embedded model, several times over
def test_fp8_at_load_time_stays_close_to_float32(default_model_dir, tiny_model_dir) -> None:
    fp8 = load_model(default_model_dir, torch.float32, CPU, quantization="fp8")
    assert isinstance(fp8.layers[0].gate_up_proj, Fp8Linear) and fp8.layers[0].qkv_proj.weight.dtype == FP8
    assert fp8.embed_tokens.weight.dtype == torch.float32 and fp8.norm.dtype == torch.float32
    text = (Path(__file__).parents[3] / "bench" / "data" / "eval.txt").read_text()
    tokens = Tokenizer.from_dir(default_model_dir).encode(text)[:256]
    reference, logits = prompt_logits(load_model(default_model_dir, torch.float32, CPU), tokens), prompt_logits(fp8, tokens)
    assert rel_err(logits, reference) < 0.12  # bf16 is at 0.015, FP8's 3-bit mantissa at about 0.07
    assert _agreement(logits, reference) >= 0.8
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), quantization="fp8", kv_cache_memory="64MiB"))
    [out] = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert "Paris" in out.text
    # Merged QKV with a bias, and random shapes, quantize as they load too.
    path, _ = tiny_model_dir("tiny-qwen2")
    assert rel_err(prompt_logits(load_model(path, torch.float32, CPU, quantization="fp8"), PROMPT),
                   prompt_logits(load_model(path, torch.float32, CPU), PROMPT)) < 0.2
    assert len(greedy("random:tiny-llama3", quantization="fp8")) == 8


@pytest.mark.parametrize("scale_shape", ["tensor", "tensor-0d", "channel"])
def test_fp8_checkpoint_loads(tiny_model_dir, tmp_path, scale_shape) -> None:
    """compressed-tensors style: float8 weights, a weight_scale per tensor (q, k and v each their own,
    so the merged QKV gets three) or per channel, and static input scales we do not need."""
    src = tiny_model_dir("tiny-llama3")[0]
    tensors, floats, fp8 = load_file(src / "model.safetensors"), {}, {}
    for name, t in tensors.items():
        if not name.endswith("_proj.weight"):
            floats[name] = fp8[name] = t
            continue
        amax = t.abs().amax(dim=1, keepdim=True) if scale_shape == "channel" else t.abs().max()
        scale = (amax / FP8_MAX).float()
        q = (t / scale).to(FP8)
        floats[name] = q.float() * scale
        fp8[name] = q
        base = name.removesuffix(".weight")
        fp8[base + ".weight_scale"] = scale if scale_shape == "channel" else (
            scale.reshape(1) if scale_shape == "tensor" else scale.reshape(()))
        fp8[base + ".input_scale"] = torch.ones(1)
    config = json.loads((src / "config.json").read_text())
    strategy = "channel" if scale_shape == "channel" else "tensor"
    (tmp_path / "f").mkdir()
    save_file(floats, tmp_path / "f" / "model.safetensors")
    (tmp_path / "f" / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {"type": "float", "num_bits": 8, "strategy": strategy,
                                                  "symmetric": True, "dynamic": False},
                                      "input_activations": {"type": "float", "num_bits": 8, "strategy": "tensor",
                                                            "dynamic": False}}}}
    (tmp_path / "q").mkdir()
    save_file(fp8, tmp_path / "q" / "model.safetensors")
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path / "q", torch.float32, CPU)
    assert model.quant == QuantConfig("fp8")
    torch.testing.assert_close(prompt_logits(model, PROMPT), prompt_logits(load_model(tmp_path / "f", torch.float32, CPU),
                                                                           PROMPT), rtol=1e-4, atol=1e-4)
    # The same checkpoint served with --quantization fp8 is served as it is.
    assert load_model(tmp_path / "q", torch.float32, CPU, quantization="fp8").quant == QuantConfig("fp8")


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({**AWQ, "bits": 8}, "AWQ with bits=8"),
    ({**AWQ, "version": "gemv"}, "version='gemv'"),
    ({**AWQ, "zero_point": False}, "zero_point=False"),
    ({**AWQ, "group_size": -1}, "group_size must be a positive integer"),
    ({**AWQ, "group_size": 48}, "group size 48 does not fit"),
    ({**AWQ, "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}, "leaves decoder linear layers unquantized"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}},
     "minillm serves only FP8"),
    ({"quant_method": "compressed-tensors"}, "without config_groups"),
    ({**AWQ, "lm_head": "yes"}, "lm_head must be true or false"),
    ({**AWQ, "group_size": 64, "lm_head": True, "vocab_size": 500}, "does not fit lm_head"),
])
def test_bad_quantization_configs_are_named(tiny_model_dir, qc, message) -> None:
    config = json.loads((tiny_model_dir("tiny-llama3")[0] / "config.json").read_text())
    config["vocab_size"] = qc.pop("vocab_size", config["vocab_size"])
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf({**config, "quantization_config": qc})


def test_quantization_flag_is_checked(tiny_model_dir, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="quantization must be one of fp8"):
        load_model("random:tiny-llama3", torch.float32, CPU, quantization="int8")
    _, awq_dir = _float_and_awq_by_hand(tiny_model_dir("tiny-llama3")[0], tmp_path)
    with pytest.raises(ModelLoadError, match=r"already quantized \(awq\)"):
        LLMEngine(EngineConfig(model=str(awq_dir), quantization="fp8", kv_cache_memory="16MiB"))
    # A checkpoint that says AWQ but holds float weights names the first tensor it did not expect.
    shutil.copy(tiny_model_dir("tiny-llama3")[0] / "model.safetensors", awq_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"Unexpected tensor .*_proj\.weight"):
        load_model(awq_dir, torch.float32, CPU)

