"""Writing a quantized model: its tensors under Hugging Face names in AutoAWQ's int4 GEMM layout
(`<proj>.qweight/.qzeros/.scales`, the rest in float16) or compressed-tensors' FP8 layout
(`<proj>.weight` in float8_e4m3fn with `<proj>.weight_scale` [N, 1], the rest in bfloat16), the
matching quantization_config, and the output directory."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.loader import layer_projections
from engine.model_store import COMPLETE_MARKER
from engine.models.llama import DecoderModel
from engine.quantization.grid import Grid, quantize_weight
from kernels.fp8_linear import quantize_fp8

_WEIGHT_FILES = ("config.json", "model.safetensors.index.json", COMPLETE_MARKER)


def _export(model: DecoderModel, dtype: torch.dtype,
            quantize_projection: Callable[[torch.nn.Module, slice], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face names: each decoder projection (rows `rows` of a linear
    module's weight [N, K]) as the leaves quantize_projection makes of it, everything else in dtype."""
    def plain(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype).cpu().contiguous()

    out = {"model.embed_tokens.weight": plain(model.embed_tokens.weight), "model.norm.weight": plain(model.norm)}
    if model.lm_head is not None:
        out["lm_head.weight"] = plain(model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = plain(layer.input_layernorm)
        out[p + "post_attention_layernorm.weight"] = plain(layer.post_attention_layernorm)
        for name, (module, start, size) in layer_projections(model.cfg, layer).items():
            leaves = quantize_projection(module, slice(start, start + size))
            out |= {f"{p}{name}.{leaf}": t.cpu().contiguous() for leaf, t in leaves.items()}
            if module.bias is not None:
                out[f"{p}{name}.bias"] = plain(module.bias[start:start + size])
    return out


def export_awq(model: DecoderModel, group_size: int, grids: dict[torch.nn.Module, Grid] | None = None,
               lm_head: tuple[torch.Tensor, Grid | None] | None = None) -> dict[str, torch.Tensor]:
    """Decoder linear layers packed in AutoAWQ's GEMM layout (on `grids` where a module has them),
    everything else in float16; with `lm_head` (a weight [V, H] and its grids, or None for its own
    min/max grids), lm_head packed the same way too (the embedding stays float16 even if tied)."""
    def int4(module: torch.nn.Module, rows: slice) -> dict[str, torch.Tensor]:
        grid = (grids or {}).get(module)
        return quantize_weight(module.weight[rows], group_size, None if grid is None else (grid[0][rows], grid[1][rows]))

    tensors = _export(model, torch.float16, int4)
    if lm_head is not None:
        tensors.pop("lm_head.weight", None)
        tensors |= {f"lm_head.{leaf}": t for leaf, t in quantize_weight(lm_head[0], group_size, lm_head[1]).items()}
    return tensors


def export_fp8(model: DecoderModel) -> dict[str, torch.Tensor]:
    """Decoder linear weights in FP8 with a float32 scale per output feature ([N, 1], as
    compressed-tensors writes it), everything else in bfloat16. Weights already on their FP8 grid
    (fp8_gptq_calibrate) come out exactly."""
    def fp8(module: torch.nn.Module, rows: slice) -> dict[str, torch.Tensor]:
        weight, scale = quantize_fp8(module.weight[rows])
        return {"weight": weight, "weight_scale": scale[:, None]}

    return _export(model, torch.bfloat16, fp8)


def fp8_quantization_config() -> dict:
    """compressed-tensors' FP8 scheme with per-channel weights (activations: dynamic per token, as
    minillm's prefill on Hopper does them)."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True,
                            "dynamic": False},
                "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True,
                                      "dynamic": True}}}}


def awq_quantization_config(group_size: int, lm_head: bool = False) -> dict:
    """AutoAWQ's config; `lm_head: true` (GPTQ's key for it) only where lm_head is int4 too."""
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    return config | ({"lm_head": True} if lm_head else {})


def write_checkpoint(src: Path, out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict,
                     dtype: str) -> None:
    """Write `out` (absent or empty) as a whole, through a temporary directory beside it: the tensors
    as model.safetensors, src's config.json with quantization_config and its dtype set to `dtype`,
    and src's other files but its weights (tokenizer, chat template, generation config)."""
    hf_config = json.loads((src / "config.json").read_text())
    hf_config["quantization_config"] = quantization_config
    hf_config["torch_dtype" if "torch_dtype" in hf_config else "dtype"] = dtype
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        for path in src.iterdir():
            if path.is_file() and path.suffix != ".safetensors" and path.name not in _WEIGHT_FILES:
                shutil.copy2(path, tmp / path.name)
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
