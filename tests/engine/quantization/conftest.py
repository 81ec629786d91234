"""What the quantization tests share: a tiny model with a real tokenizer (awq and fp8-gptq tokenize
their calibration text), a hand-built AWQ checkpoint, and greedy decoding through the engine."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kernels.int4_layout import dequantize_awq, pack_awq

CPU = torch.device("cpu")
PROMPT = list(range(5, 45))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


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


def greedy(model: str | Path, n: int = 8, **config) -> list[int]:
    """The n tokens greedy decoding gives after PROMPT, through the engine."""
    engine = LLMEngine(EngineConfig(model=str(model), kv_cache_memory="16MiB", **config))
    [out] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return out.token_ids


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return ((a - b).norm() / b.norm()).item()


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
