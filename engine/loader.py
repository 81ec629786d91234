"""Build a DecoderModel from a Hugging Face directory (safetensors) or a named random shape."""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config import LOAD_TIME_QUANTIZATION
from engine.distributed import SINGLE, TensorParallel
from engine.errors import ModelLoadError
from engine.models.config import RANDOM_PREFIX, ModelConfig, QuantConfig, model_config
from engine.models.linear import Int4Linear, linear_class
from engine.models.llama import DecoderLayer, DecoderModel
from kernels.fp8_linear import FP8
from kernels.rope import rope_inv_freq

# Tensors some checkpoints carry that the decoder recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# FP8 checkpoints' static activation and KV-cache scales: minillm keeps activations and KV in the
# model's dtype, so it needs none of them.
_FP8_IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")


def checkpoint_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this shape holds, by name (its linear layers in the
    layout of cfg.quantization: float, AWQ or FP8)."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if cfg.quantization is not None and cfg.quantization.lm_head:
        shapes |= {f"lm_head.{leaf}": shape for leaf, shape in
                   Int4Linear.checkpoint_shapes(h, cfg.vocab_size, False, cfg.quantization).items()}
    elif not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    linear = linear_class(cfg.quantization)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        for name, (k, n) in cfg.linear_features().items():
            bias = cfg.qkv_bias and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            shapes |= {f"{p}{name}.{leaf}": shape
                       for leaf, shape in linear.checkpoint_shapes(k, n, bias, cfg.quantization).items()}
    return shapes


def _shape_ok(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    if name.endswith(".weight_scale"):  # FP8: one scale per tensor, or per output feature ([N] or [N, 1])
        return math.prod(shape) in (1, expected[0]) and len(shape) <= 2
    return shape == expected


def layer_projections(cfg: ModelConfig, layer: DecoderLayer) -> dict[str, tuple[nn.Module, int, int]]:
    """Each checkpoint projection of a layer: (our linear module, first output feature, size), in
    the layer's own features (this rank's shard under tensor parallelism)."""
    q, kv, inter = layer.num_heads * cfg.head_dim, layer.num_kv_heads * cfg.head_dim, layer.intermediate_size
    return {
        "self_attn.q_proj": (layer.qkv_proj, 0, q),
        "self_attn.k_proj": (layer.qkv_proj, q, kv),
        "self_attn.v_proj": (layer.qkv_proj, q + kv, kv),
        "self_attn.o_proj": (layer.o_proj, 0, cfg.hidden_size),
        "mlp.gate_proj": (layer.gate_up_proj, 0, inter),
        "mlp.up_proj": (layer.gate_up_proj, inter, inter),
        "mlp.down_proj": (layer.down_proj, 0, cfg.hidden_size),
    }


def _load_vocab_rows(weight: torch.Tensor, tensor: torch.Tensor, first: int) -> None:
    """This rank's rows of the embedding or lm_head; rows past the vocabulary (padding) are zero."""
    count = max(0, min(weight.shape[0], tensor.shape[0] - first))
    weight[:count].copy_(tensor[first:first + count])
    weight[count:].zero_()


def _load_tensor(model: DecoderModel, name: str, tensor: torch.Tensor) -> None:
    """Copy (this rank's shard of) a checkpoint tensor into its parameter, or into its slice of a
    merged projection."""
    if name == "model.embed_tokens.weight":
        _load_vocab_rows(model.embed_tokens.weight, tensor, model.shard.vocab_rows[0])
        return
    if name == "model.norm.weight":
        model.norm.copy_(tensor)
        return
    if name == "lm_head.weight":
        _load_vocab_rows(model.lm_head.weight, tensor, model.shard.vocab_rows[0])
        return
    if name.startswith("lm_head."):  # an int4 lm_head (one GPU: its rows are the whole vocabulary)
        model.lm_head.load(name.split(".", 1)[1], tensor, 0, model.cfg.vocab_size)
        return
    parts = name.split(".")
    layer = model.layers[int(parts[2])]
    kind, leaf = ".".join(parts[3:-1]), parts[-1]
    projections = layer_projections(model.cfg, layer)
    if kind in projections:
        module, start, size = projections[kind]
        module.load(leaf, module.shard(leaf, tensor, *model.shard.projection(kind, model.cfg)), start, size)
        return
    {"input_layernorm": layer.input_layernorm, "post_attention_layernorm": layer.post_attention_layernorm}[kind].copy_(tensor)


def load_weights(model: DecoderModel, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model; every expected tensor must come, with its shape."""
    expected = checkpoint_tensor_shapes(model.cfg)
    fp8_checkpoint = model.cfg.quantization is not None and model.cfg.quantization.method == "fp8"
    ignored = _IGNORED_SUFFIXES + (_FP8_IGNORED_SUFFIXES if fp8_checkpoint else ())
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in tensors:
            if name.endswith(ignored) or (name == "lm_head.weight" and model.lm_head is None):
                continue
            if name not in expected:
                raise ModelLoadError(f"Unexpected tensor {name!r} in checkpoint for {model.cfg.architecture}.")
            if not _shape_ok(name, tuple(tensor.shape), expected[name]):
                raise ModelLoadError(
                    f"Tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}."
                )
            if fp8_checkpoint and name.endswith("_proj.weight") and tensor.dtype != FP8:
                raise ModelLoadError(f"Tensor {name!r} is {tensor.dtype}; an FP8 checkpoint's are float8_e4m3fn.")
            _load_tensor(model, name, tensor)
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


def load_model(model: str | Path, dtype: torch.dtype, device: torch.device, seed: int = 0,
               quantization: str | None = None, tp: TensorParallel = SINGLE) -> DecoderModel:
    """A ready DecoderModel (weights in place, eval mode) from a directory or a `random:<shape>` name.

    quantization="fp8" quantizes a float checkpoint's linear weights to FP8 (per output feature) as
    they load; an FP8 checkpoint is served as it is. Under tensor parallelism each rank reads every
    tensor and keeps its shard (random weights are the same on every rank: the same seeded draws)."""
    cfg = model_config(model)
    quant = cfg.quantization
    if quantization:  # None or "": the checkpoint's own format
        if quantization not in LOAD_TIME_QUANTIZATION:
            raise ModelLoadError(f"quantization must be one of {', '.join(LOAD_TIME_QUANTIZATION)} or unset; "
                                 f"got {quantization!r}.")
        if quant is not None and quant.method != quantization:
            raise ModelLoadError(f"{model} is already quantized ({quant.method}); it cannot be served as "
                                 f"{quantization}: leave --quantization unset.")
        quant = QuantConfig(quantization)
    with torch.device("meta"):
        decoder = DecoderModel(cfg, dtype, quant, tp)
    decoder = decoder.to_empty(device=device)
    # Buffers are not in checkpoints: meta-device construction left this one empty.
    decoder.inv_freq.copy_(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    if str(model).startswith(RANDOM_PREFIX):
        load_weights(decoder, random_tensors(cfg, seed, device))
    else:
        load_weights(decoder, iter_safetensors(Path(model)))
    for module in decoder.modules():
        if isinstance(module, Int4Linear):  # AWQ's checkpoint layout → the kernels' runtime layout
            module.repack()
    return decoder.eval().requires_grad_(False)

