"""The layer shapes the GPU kernel tests run at: the benchmark's three named shapes
(engine/models/shapes.py), so that each fused kernel is checked at every head and hidden size the
benchmark times."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.shapes import SHAPES as MODEL_SHAPES


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def qkv(self) -> int:
        """Outputs of the merged QKV projection."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """(K, N) of the layer's merged QKV, O, merged gate/up and down projections."""
        return {"qkv": (self.hidden, self.qkv), "o": (self.heads * self.head_dim, self.hidden),
                "gate_up": (self.hidden, 2 * self.intermediate), "down": (self.intermediate, self.hidden)}


def _layer(name: str) -> LayerShape:
    c = MODEL_SHAPES[name]
    heads = c["num_attention_heads"]
    return LayerShape(c["hidden_size"], heads, c["num_key_value_heads"], c.get("head_dim", c["hidden_size"] // heads),
                      c["intermediate_size"])


LAYERS = {name: _layer(name) for name in ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b")}
