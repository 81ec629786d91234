"""The shape of a decoder, read from a Hugging Face config.json (or a named shape)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

# Architectures our one decoder serves, with what differs between them.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias": False},
    "MistralForCausalLM": {"qkv_bias": False},
    "Qwen2ForCausalLM": {"qkv_bias": True},
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder, the KV cache and the loader need to know about a model's shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type plus its parameters
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict; raises ModelLoadError for what we cannot serve."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"Unsupported architecture {arch!r}: minillm serves {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        if hf.get("mlp_bias"):
            raise ModelLoadError(f"{arch} with mlp_bias=true is not supported.")
        # transformers 5 keeps rope settings in rope_parameters; older configs in rope_theta/rope_scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        rope["rope_type"] = rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"RoPE type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES}).")
        # Qwen2 configs carry a sliding_window that only applies when use_sliding_window is set.
        window = hf.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
            window = None
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        qkv_bias = SUPPORTED_ARCHITECTURES[arch]["qkv_bias"] or bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            rope_scaling=rope,
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: Path) -> "ModelConfig":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"No config.json in model directory {path}.")
        return cls.from_hf(json.loads(config_path.read_text()))

    def check_context(self, max_model_len: int) -> None:
        """Reject a sliding window we would silently ignore: it would change the model's outputs."""
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ModelLoadError(
                f"This model uses a sliding attention window of {self.sliding_window} tokens, shorter than "
                f"max_model_len={max_model_len}; minillm has no sliding-window attention. "
                f"Set --max-model-len {self.sliding_window} or lower."
            )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
