"""Quantized checkpoints: AWQ int4 (written by `minillm quantize`, or built by hand), FP8 at load
time and FP8 checkpoints, and clear errors for quantization configs we cannot serve."""
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
from engine.models.config import ModelConfig, QuantConfig, parse_quantization
from engine.models.linear import Fp8Linear, Int4Linear
from engine.models.llama import DecoderModel
from engine.packed_prefill import prompt_logits
from engine.quantize import (
    TUNE_HELD_OUT, _kl, _next_token_logprobs, awq_calibrate, calibration_sequences, default_group_size, gptq_round,
    int4_gptq, int4_gptq_calibrate, int4_lm_head_calibrate, quantize_checkpoint, quantize_weight, tune_end_to_end,
    tuning_targets,
)
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from kernels.fp8_linear import FP8, FP8_MAX
from kernels.rmsnorm import rms_norm
from kernels.int4_linear import dequantize_awq, pack_awq, unpack_awq

CPU = torch.device("cpu")
PROMPT = list(range(5, 45))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_model_dir, default_model_dir, tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer: AWQ tokenizes its calibration text."""
    path, _ = tiny_model_dir("tiny-llama3", vocab_size=49152)
    dst = tmp_path_factory.mktemp("tiny-tok")
    shutil.copytree(path, dst, dirs_exist_ok=True)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, dst / name)
    return dst


def _greedy(model: str | Path, n: int = 8, **config) -> list[int]:
    engine = LLMEngine(EngineConfig(model=str(model), kv_cache_memory="16MiB", **config))
    [out] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return out.token_ids


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of positions whose top-1 token two logits tensors agree on."""
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_quantized_directory_loads_back_and_generates(tiny_with_tokenizer, tmp_path, method) -> None:
    out = quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "q", method, group_size=32, calibration_tokens=256)
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
    assert len(_greedy(out)) == 8
    # Random tiny weights amplify any error (a real model's is far smaller): a sanity bound only.
    reference = prompt_logits(load_model(tiny_with_tokenizer, torch.float32, CPU), PROMPT)
    assert _rel(prompt_logits(quantized, PROMPT), reference) < 0.6


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_int4_lm_head_checkpoint(tiny_with_tokenizer, tmp_path, method) -> None:
    """--lm-head: lm_head int4 as well (tied here: the embedding stays float16), loaded as an
    Int4Linear whose dequantized weight gives the logits, within the layers' error of the float model."""
    plain = quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "p", method, group_size=32, calibration_tokens=256)
    out = quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "q", method, group_size=32, calibration_tokens=256,
                              lm_head=True)
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
    assert len(_greedy(out)) == 8
    reference = prompt_logits(original, PROMPT)
    assert _rel(prompt_logits(model, PROMPT), reference) < 0.6


def test_int4_lm_head_of_an_untied_model(tiny_model_dir, tmp_path) -> None:
    path, _ = tiny_model_dir("tiny-llama3", tie_word_embeddings=False)
    out = quantize_checkpoint(str(path), tmp_path / "q", "rtn", group_size=32, lm_head=True)
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    model, original = load_model(out, torch.float32, CPU), load_model(path, torch.float32, CPU)
    step = model.lm_head.weight_scales.float().repeat_interleave(32, dim=1)
    w = original.lm_head.weight
    assert ((model.lm_head.dequantize().float() - w).abs() <= 0.5 * step + 2e-3 * w.abs() + 1e-6).all()


@pytest.mark.parametrize("kernel", ["int4-small-tiling", "int4-large-tiling", "fp8"])
def test_batch1_decode_folds_the_norms_into_the_quantized_projections(tiny_with_tokenizer, tmp_path, triton_interpreter,
                                                                      monkeypatch, kernel) -> None:
    """One token through an int4 or FP8 model runs 2 norm kernels, not 2L + 1 (the rest are the
    one-row kernels' add-norm epilogues and scaled outputs), and gives the logits of the unfolded path."""
    import engine.models.llama as llama
    import kernels.int4_linear as int4_linear_module

    large = kernel == "int4-large-tiling"
    if kernel == "fp8":
        model = load_model(tiny_with_tokenizer, torch.float32, CPU, quantization="fp8")
    else:
        model = load_model(quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "q", "rtn", group_size=32),
                           torch.float32, CPU)
    if large:  # the tiny weights would all take the small weights' tiling
        monkeypatch.setattr(int4_linear_module, "STREAM_WEIGHTS", 0)
    calls = []
    monkeypatch.setattr(llama, "rms_norm", lambda *a, **k: calls.append(1) or rms_norm(*a, **k))
    folded = prompt_logits(model, PROMPT[:1])
    assert model.fold_norms and len(calls) == 2
    model.fold_norms = False
    apart = prompt_logits(model, PROMPT[:1])
    assert len(calls) == 2 + 2 * model.cfg.num_layers + 1
    # The stream kernel's float32 sums keep ~2**-20 of sum |x| (tests/kernels), which these random
    # weights' cancellations make ~1e-5 of the logits; FP8's products are exact in float32.
    assert _rel(folded, apart) < (1e-6 if kernel == "fp8" else 1e-4)


def test_int4_lm_head_is_one_gpu_only(tiny_model_dir) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir("tiny-llama3")[0])
    with torch.device("meta"), pytest.raises(ModelLoadError, match="one GPU only"):
        DecoderModel(cfg, torch.float32, QuantConfig("awq", 32, lm_head=True), TensorParallel(rank=0, size=2))


def test_rtn_weights_are_within_half_a_step(tiny_with_tokenizer, tmp_path) -> None:
    out = quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "q", "rtn", group_size=32)
    original, quantized = load_model(tiny_with_tokenizer, torch.float32, CPU), load_model(out, torch.float32, CPU)
    for a, b in zip(original.layers, quantized.layers):
        for linear in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            w, q = getattr(a, linear).weight, getattr(b, linear)
            step = q.weight_scales.float().repeat_interleave(32, dim=1)
            err = (q.dequantize().float() - w).abs()
            assert (err <= 0.5 * step + 2e-3 * w.abs() + 1e-6).all(), linear


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


def _float_and_awq_by_hand(src: Path, tmp_path: Path, group_size: int = 32) -> tuple[Path, Path]:
    """From a float checkpoint's shapes: known 4-bit ints, zeros and scales per projection, saved both
    AWQ-packed and as the float weights they stand for."""
    gen = torch.Generator().manual_seed(0)
    tensors = load_file(src / "model.safetensors")
    floats, packed = dict(tensors), {}
    for name, t in tensors.items():
        if not name.endswith("_proj.weight"):
            packed[name] = t
            continue
        n, k = t.shape
        q = torch.randint(0, 16, (k, n), generator=gen)
        z = torch.randint(0, 16, (k // group_size, n), generator=gen)
        s = (torch.rand(k // group_size, n, generator=gen) * 0.02 + 0.01).half()
        base = name.removesuffix(".weight")
        packed |= {base + ".qweight": pack_awq(q), base + ".qzeros": pack_awq(z), base + ".scales": s}
        floats[name] = dequantize_awq(pack_awq(q), pack_awq(z), s, group_size).float().t().contiguous()
    float_dir, awq_dir = tmp_path / "float", tmp_path / "awq"
    for path, weights in ((float_dir, floats), (awq_dir, packed)):
        path.mkdir()
        save_file(weights, path / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (float_dir / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                     "zero_point": True, "version": "gemm"}
    (awq_dir / "config.json").write_text(json.dumps(config))
    return float_dir, awq_dir


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
    assert _greedy(awq_dir) == _greedy(float_dir)


def test_fp8_at_load_time_stays_close_to_float32(default_model_dir, tiny_model_dir) -> None:
    fp8 = load_model(default_model_dir, torch.float32, CPU, quantization="fp8")
    assert isinstance(fp8.layers[0].gate_up_proj, Fp8Linear) and fp8.layers[0].qkv_proj.weight.dtype == FP8
    assert fp8.embed_tokens.weight.dtype == torch.float32 and fp8.norm.dtype == torch.float32
    text = (Path(__file__).parents[2] / "bench" / "data" / "eval.txt").read_text()
    tokens = Tokenizer.from_dir(default_model_dir).encode(text)[:256]
    reference, logits = prompt_logits(load_model(default_model_dir, torch.float32, CPU), tokens), prompt_logits(fp8, tokens)
    assert _rel(logits, reference) < 0.12  # bf16 is at 0.015, FP8's 3-bit mantissa at about 0.07
    assert _agreement(logits, reference) >= 0.8
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), quantization="fp8", kv_cache_memory="64MiB"))
    [out] = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert "Paris" in out.text
    # Merged QKV with a bias, and random shapes, quantize as they load too.
    path, _ = tiny_model_dir("tiny-qwen2")
    assert _rel(prompt_logits(load_model(path, torch.float32, CPU, quantization="fp8"), PROMPT),
                prompt_logits(load_model(path, torch.float32, CPU), PROMPT)) < 0.2
    assert len(_greedy("random:tiny-llama3", quantization="fp8")) == 8


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


def test_quantize_refuses_what_it_cannot_do(tiny_model_dir, tiny_with_tokenizer, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="group size 48 does not fit"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "a", "rtn", group_size=48)
    with pytest.raises(ModelLoadError, match="tune_steps must be 0"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "a", "awq", tune_steps=-1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ModelLoadError, match="not an empty directory"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "full", "rtn")
    with pytest.raises(ModelLoadError, match="has none"):  # AWQ needs a tokenizer for its calibration text
        quantize_checkpoint(str(tiny_model_dir("tiny-llama3")[0]), tmp_path / "b", "awq")
    _, awq_dir = _float_and_awq_by_hand(tiny_model_dir("tiny-llama3")[0], tmp_path)
    with pytest.raises(ModelLoadError, match="already quantized"):
        quantize_checkpoint(str(awq_dir), tmp_path / "c", "rtn")
    with pytest.raises(ModelLoadError, match="leave --group-size out"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "d", "fp8-gptq", group_size=32)
    with pytest.raises(ModelLoadError, match="--lm-head is for int4"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "e", "fp8-gptq", lm_head=True)
    with pytest.raises(ModelLoadError, match="is not a file"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "f", "awq", calibration_text=tmp_path / "missing.txt")
    (tmp_path / "one.txt").write_text("a")
    with pytest.raises(ModelLoadError, match="rtn reads no calibration text"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "f", "rtn", calibration_text=tmp_path / "one.txt")
    with pytest.raises(ModelLoadError, match="at least 2 tokens"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "f", "fp8-gptq", calibration_text=tmp_path / "one.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ModelLoadError, match="cannot read calibration text"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "f", "fp8-gptq", calibration_text=tmp_path / "latin1.txt")
    assert not (tmp_path / "f").exists()
    assert parse_quantization(None) is None


def test_calibration_sequences_read_the_given_text(tiny_with_tokenizer, tmp_path) -> None:
    """The shipped text by default (the Declaration first), or the given file's, cut at max_tokens
    into sequences of up to seq_len."""
    tokenizer = Tokenizer.from_dir(tiny_with_tokenizer)
    shipped = calibration_sequences(tokenizer, 40, seq_len=16)
    assert [len(s) for s in shipped] == [16, 16, 8]
    assert tokenizer.decode(shipped[0]).startswith("In Congress, July 4, 1776.")
    text = tmp_path / "mine.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    mine = calibration_sequences(tokenizer, 1000, seq_len=64, text=text)
    assert [t for s in mine for t in s] == tokenizer.encode(text.read_text())


def test_gptq_rounding_beats_round_to_nearest_on_the_output() -> None:
    """GPTQ minimizes the output error on its Hessian's inputs: tr((W - Q) H (W - Q)^T), below
    rounding each weight to its nearest level, on correlated inputs; and each column stays on the grid."""
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(64, 64, generator=gen)
    x = torch.randn(512, 64, generator=gen) @ mix  # correlated input features
    w = torch.randn(32, 64, generator=gen)
    step = 0.25

    def nearest(col: torch.Tensor, _k: int = 0) -> torch.Tensor:
        return torch.round(col / step) * step

    def output_error(q: torch.Tensor) -> float:
        return (x @ (w - q).t()).pow(2).mean().item()

    q = gptq_round(w, 2 * x.t() @ x / x.shape[0], nearest, damp=0.01)
    assert torch.equal(q, nearest(q))
    assert output_error(q) < 0.5 * output_error(nearest(w))


def test_int4_gptq_rounds_onto_the_grids_it_exports() -> None:
    """AWQ's GPTQ step: each weight lands on a level of its group's grid (made from the weight before
    rounding), the export writes exactly those levels with that grid, and the output error is
    below rounding to nearest on correlated inputs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=gen) @ torch.randn(64, 64, generator=gen)
    w = torch.randn(16, 64, generator=gen)
    rounded, scale, zero = int4_gptq(w, x, 32)
    packed = quantize_weight(rounded, 32, (scale, zero))
    levels = unpack_awq(packed["qweight"]).t().float()  # [N, K]
    zeros = unpack_awq(packed["qzeros"]).t().float().repeat_interleave(32, dim=1)
    scales = packed["scales"].t().float().repeat_interleave(32, dim=1)
    assert torch.equal((levels - zeros) * scales, rounded)
    nearest = quantize_weight(w, 32)
    nearest_w = (unpack_awq(nearest["qweight"]).t() - unpack_awq(nearest["qzeros"]).t().repeat_interleave(32, dim=1)
                 ) * nearest["scales"].t().float().repeat_interleave(32, dim=1)
    assert (x @ (w - rounded).t()).pow(2).mean() < 0.8 * (x @ (w - nearest_w).t()).pow(2).mean()


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
    assert len(_greedy(out)) == 8
    reference = prompt_logits(load_model(tiny_with_tokenizer, torch.float32, CPU), PROMPT)
    assert _rel(prompt_logits(quantized, PROMPT), reference) < 0.2


def test_end_to_end_tuning_keeps_the_levels_and_lowers_the_held_out_kl(tiny_with_tokenizer, monkeypatch) -> None:
    """The tuning moves only group scales (still float16 values) and norm weights: every weight stays
    (its level - its zero point) * its group's scale, with the levels and zero points GPTQ chose,
    and the next-token KL from the float model on the held-out end of the text goes down. With the
    Triton kernels on (the interpreter here, as a GPU would) it still differentiates: through the
    torch references."""
    teacher = load_model(tiny_with_tokenizer, torch.float32, CPU)
    model = load_model(tiny_with_tokenizer, torch.float32, CPU)
    sequences = calibration_sequences(Tokenizer.from_dir(tiny_with_tokenizer), 2048)
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
    tune_end_to_end(model, targets, grids, 32, steps=10)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert held_out_kl() < before
    assert not torch.equal(model.norm, norm) and not torch.equal(grids[head][0], head_scale)
    for module, (scale, zero) in grids.items():
        assert torch.equal(scale, scale.half().float()) and (scale > 0).all() and torch.equal(zero, zeros[module])
        step = scale.repeat_interleave(32, 1)
        assert torch.equal(module.weight, levels[module] * step)
        exported = quantize_weight(module.weight, 32, (scale, zero))
        assert torch.equal(unpack_awq(exported["qweight"]).t().float() - zero.repeat_interleave(32, 1), levels[module])


def test_default_group_size_follows_the_source_blocks_where_they_fit(default_model_dir, tiny_model_dir) -> None:
    # SmolLM2 (hidden 576: 128 does not fit) was Q4_1 in blocks of 32; a Llama shape takes 128 unless
    # its weights came from such blocks; a block that does not fit the layers is passed over.
    smol = ModelConfig.from_dir(default_model_dir)
    assert default_group_size(smol) == 64 and default_group_size(smol, 32) == 32
    tiny = ModelConfig.from_dir(tiny_model_dir("tiny-llama3")[0])
    assert default_group_size(tiny) == 64 and default_group_size(tiny, 32) == 32 and default_group_size(tiny, 256) == 64
