"""The shape of a decoder, read from a Hugging Face config.json (or a named shape)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.models.shapes import shape_config

# Architectures our one decoder serves, with what differs between them.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias": False},
    "MistralForCausalLM": {"qkv_bias": False},
    "Qwen2ForCausalLM": {"qkv_bias": True},
}
RANDOM_PREFIX = "random:"  # a model named random:<shape> has seeded random weights (engine/models/shapes.py)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# The decoder's linear layers, the only ones a quantized checkpoint may quantize.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class QuantConfig:
    """How the decoder's linear weights are stored: "awq" (4-bit, AutoAWQ's GEMM layout, groups of
    `group_size` input features) or "fp8" (float8_e4m3fn with a float32 scale per output feature).
    With `lm_head`, the output projection is stored as AWQ int4 as well (the input embedding stays
    float): at batch 1 it is the largest weight a 1B model's int4 step reads."""

    method: str
    group_size: int = 0  # awq only
    lm_head: bool = False  # awq only: lm_head is int4 too (GPTQ's `lm_head` key; AutoAWQ leaves it float)


def _not_decoder(modules: Any, what: str) -> None:
    """A quantized checkpoint may leave lm_head (or other non-decoder modules) unquantized, not
    some of the decoder's linear layers: minillm quantizes all of them or none."""
    named = [m for m in modules or [] if any(n in str(m) for n in LINEAR_NAMES)]
    if named:
        raise ModelLoadError(f"quantization_config: {what} {named[:3]} leaves decoder linear layers unquantized; "
                             "minillm needs all of q/k/v/o/gate/up/down_proj quantized alike.")


def parse_quantization(qc: dict[str, Any] | None) -> QuantConfig | None:
    """A config.json's quantization_config → QuantConfig; ModelLoadError naming what we cannot serve."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
            raise ModelLoadError(f"quantization_config: AWQ with bits={bits}, version={version!r}, "
                                 f"zero_point={qc.get('zero_point', True)} is not supported (only 4-bit GEMM with zero points).")
        if not isinstance(group, int) or group <= 0:
            raise ModelLoadError(f"quantization_config: AWQ group_size must be a positive integer, got {group!r}.")
        _not_decoder(qc.get("modules_to_not_convert"), "modules_to_not_convert")
        lm_head = qc.get("lm_head", False)
        if not isinstance(lm_head, bool):
            raise ModelLoadError(f"quantization_config: lm_head must be true or false, got {lm_head!r}.")
        return QuantConfig("awq", group, lm_head)
    if method == "fp8":  # AutoFP8 / vLLM style: per-tensor (or per-channel) weight_scale
        if qc.get("weight_block_size"):
            raise ModelLoadError(f"quantization_config: block-wise FP8 (weight_block_size={qc['weight_block_size']}) "
                                 "is not supported; only per-tensor or per-channel scales.")
        _not_decoder(qc.get("ignored_layers") or qc.get("modules_to_not_convert"), "ignored_layers")
        return QuantConfig("fp8")
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if not groups:
            raise ModelLoadError("quantization_config: compressed-tensors without config_groups.")
        for name, group in groups.items():
            w = group.get("weights") or {}
            if (w.get("type"), w.get("num_bits"), w.get("strategy")) not in (("float", 8, "tensor"), ("float", 8, "channel")):
                raise ModelLoadError(
                    f"quantization_config: compressed-tensors group {name!r} has weights {w.get('type')}/"
                    f"{w.get('num_bits')} bits/{w.get('strategy')}; minillm serves only FP8 (float, 8 bits) weights "
                    "with a per-tensor or per-channel scale.")
        _not_decoder(qc.get("ignore"), "ignore")
        return QuantConfig("fp8")
    raise ModelLoadError(f"quantization_config: quant_method {method!r} is not supported "
                         "(supported: awq, compressed-tensors FP8, fp8).")


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
    quantization: QuantConfig | None = None  # how the checkpoint stores the decoder's linear weights

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
        cfg = cls(
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
            quantization=parse_quantization(hf.get("quantization_config")),
        )
        if cfg.quantization is not None and cfg.quantization.method == "awq":
            cfg.check_awq_group_size(cfg.quantization.group_size, cfg.quantization.lm_head)
        return cfg

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

    def linear_features(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each of a decoder layer's linear layers, by checkpoint name."""
        h, q, kv, inter = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
                "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
                "mlp.down_proj": (inter, h)}

    def check_awq_group_size(self, group_size: int, lm_head: bool = False) -> None:
        """AWQ's layout needs whole groups of input features and whole packs of 8 output features
        (lm_head's too when it is quantized)."""
        features = self.linear_features() | ({"lm_head": (self.hidden_size, self.vocab_size)} if lm_head else {})
        for name, (k, n) in features.items():
            if k % group_size or n % 8:
                raise ModelLoadError(
                    f"AWQ group size {group_size} does not fit {name} ({k} input features, {n} output features): "
                    f"the input features must be a multiple of the group size and the outputs of 8.")

    def kv_bytes_per_token(self, dtype_bytes: int, num_kv_heads: int | None = None) -> int:
        """K and V of every layer for one token; num_kv_heads: a tensor-parallel rank's share."""
        return 2 * self.num_layers * (num_kv_heads or self.num_kv_heads) * self.head_dim * dtype_bytes


def model_config(model: str | Path) -> ModelConfig:
    """The config of a directory or of a `random:<shape>` name."""
    if str(model).startswith(RANDOM_PREFIX):
        return ModelConfig.from_hf(shape_config(str(model)[len(RANDOM_PREFIX):]))
    return ModelConfig.from_dir(Path(model))
