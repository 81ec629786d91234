"""Build a DecoderModel from a Hugging Face directory (safetensors) or a named random shape."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.models.llama import DecoderModel
from engine.models.shapes import shape_config
from kernels.rope import rope_inv_freq

RANDOM_PREFIX = "random:"
# Tensors some checkpoints carry that the decoder recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this shape holds, by name."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        }
        if cfg.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def _destination(model: DecoderModel, name: str) -> torch.Tensor | None:
    """The parameter (or merged-projection slice) a checkpoint tensor goes into."""
    cfg = model.cfg
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight
    if name == "model.norm.weight":
        return model.norm
    if name == "lm_head.weight":
        return None if model.lm_head is None else model.lm_head.weight
    parts = name.split(".")
    layer = model.layers[int(parts[2])]
    kind, leaf = ".".join(parts[3:-1]), parts[-1]
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    merged = {
        "self_attn.q_proj": (layer.qkv_proj, 0, q),
        "self_attn.k_proj": (layer.qkv_proj, q, kv),
        "self_attn.v_proj": (layer.qkv_proj, q + kv, kv),
        "mlp.gate_proj": (layer.gate_up_proj, 0, inter),
        "mlp.up_proj": (layer.gate_up_proj, inter, inter),
    }
    if kind in merged:
        module, start, size = merged[kind]
        return getattr(module, leaf).narrow(0, start, size)
    plain = {"self_attn.o_proj": layer.o_proj, "mlp.down_proj": layer.down_proj}
    if kind in plain:
        return getattr(plain[kind], leaf)
    return {"input_layernorm": layer.input_layernorm, "post_attention_layernorm": layer.post_attention_layernorm}[kind]


def load_weights(model: DecoderModel, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model; every expected tensor must come, with its shape."""
    expected = checkpoint_tensor_shapes(model.cfg)
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in tensors:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
                continue
            if name not in expected:
                raise ModelLoadError(f"Unexpected tensor {name!r} in checkpoint for {model.cfg.architecture}.")
            if tuple(tensor.shape) != expected[name]:
                raise ModelLoadError(
                    f"Tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}."
                )
            _destination(model, name).copy_(tensor)
            seen.add(name)
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"Checkpoint is missing tensor {', '.join(missing[:3])}{more}.")


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of a directory: one model.safetensors, or the shards its index names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"No *.safetensors files in model directory {path}.")
    for file in files:
        if not (path / file).is_file():
            raise ModelLoadError(f"Shard {file} named by {index.name} is missing from {path}.")
        with safe_open(path / file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def random_tensors(cfg: ModelConfig, seed: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights for a shape: norms near 1, everything else N(0, 0.02)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in checkpoint_tensor_shapes(cfg).items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02
        yield name, (t + 1.0 if name.endswith("norm.weight") else t)


def model_config(model: str | Path) -> ModelConfig:
    """The config of a directory or of a `random:<shape>` name."""
    if str(model).startswith(RANDOM_PREFIX):
        return ModelConfig.from_hf(shape_config(str(model)[len(RANDOM_PREFIX):]))
    return ModelConfig.from_dir(Path(model))


def load_model(model: str | Path, dtype: torch.dtype, device: torch.device, seed: int = 0) -> DecoderModel:
    """A ready DecoderModel (weights in place, eval mode) from a directory or a `random:<shape>` name."""
    cfg = model_config(model)
    with torch.device("meta"):
        decoder = DecoderModel(cfg, dtype)
    decoder = decoder.to_empty(device=device)
    # Buffers are not in checkpoints: meta-device construction left this one empty.
    decoder.inv_freq.copy_(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    if str(model).startswith(RANDOM_PREFIX):
        load_weights(decoder, random_tensors(cfg, seed, device))
    else:
        load_weights(decoder, iter_safetensors(Path(model)))
    return decoder.eval().requires_grad_(False)

