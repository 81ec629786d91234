"""Loading checkpoints: clear errors for what we cannot serve; named random shapes."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.llm_engine import LLMEngine
from engine.loader import load_model, model_config
from engine.models.shapes import SHAPES


def _copy(src, dst):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def test_unknown_architecture_is_named(tiny_model_dir, tmp_path) -> None:
    path = _copy(tiny_model_dir("tiny-llama3")[0], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_missing_tensor_is_named(tiny_model_dir, tmp_path) -> None:
    path = _copy(tiny_model_dir("tiny-llama3")[0], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_wrong_shape_is_named(tiny_model_dir, tmp_path) -> None:
    path = _copy(tiny_model_dir("tiny-llama3")[0], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight.*\(3, 64\)"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_mistral_sliding_window_shorter_than_context_is_rejected(tiny_model_dir) -> None:
    path, _ = tiny_model_dir("tiny-mistral", sliding_window=128)
    with pytest.raises(ModelLoadError, match="sliding attention window of 128"):
        LLMEngine(EngineConfig(model=str(path), kv_cache_memory="16MiB"))
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="16MiB", max_model_len=128))
    assert engine.max_model_len == 128


def test_missing_directory_is_named() -> None:
    with pytest.raises(ModelLoadError, match="/nonexistent/model"):
        LLMEngine(EngineConfig(model="/nonexistent/model"))


def test_named_shapes_parse_and_random_weights_are_seeded() -> None:
    for name in SHAPES:
        cfg = model_config(f"random:{name}")
        assert cfg.num_heads % cfg.num_kv_heads == 0
    assert model_config("random:llama-3.2-1b").rope_scaling["rope_type"] == "llama3"
    assert model_config("random:qwen2.5-0.5b").qkv_bias
    a = load_model("random:tiny-qwen2", torch.float32, torch.device("cpu"), seed=3)
    b = load_model("random:tiny-qwen2", torch.float32, torch.device("cpu"), seed=3)
    c = load_model("random:tiny-qwen2", torch.float32, torch.device("cpu"), seed=4)
    assert torch.equal(a.layers[0].qkv_proj.weight, b.layers[0].qkv_proj.weight)
    assert not torch.equal(a.layers[0].qkv_proj.weight, c.layers[0].qkv_proj.weight)
    with pytest.raises(ModelLoadError, match="Unknown model shape"):
        model_config("random:gpt-5")
