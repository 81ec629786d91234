"""The layer shapes the GPU kernel tests run at: the benchmark's three named shapes, as the engine
reads them (engine/models/shapes.py's configs through ModelConfig), so that each fused kernel is
checked at every head and hidden size the benchmark times."""
from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.shapes import shape_config

LAYERS = {name: ModelConfig.from_hf(shape_config(name)) for name in ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b")}


def qkv_features(cfg: ModelConfig) -> int:
    """Outputs of the merged QKV projection."""
    return (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim


def projections(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(K, N) of a layer's merged QKV, O, merged gate/up and down projections."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (h, qkv_features(cfg)), "o": (cfg.num_heads * cfg.head_dim, h), "gate_up": (h, 2 * inter),
            "down": (inter, h)}
