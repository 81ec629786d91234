"""Named model shapes (Hugging Face config dicts) for random-weight models: `random:<name>`."""
from __future__ import annotations

from typing import Any

from engine.errors import ModelLoadError

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
        "bos_token_id": 151643, "eos_token_id": 151643,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    # Tiny shapes for tests: each exercises what makes its family different.
    "tiny-llama3": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0,
                                                 "original_max_position_embeddings": 64},
        "max_position_embeddings": 1024, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "tiny-mistral": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 1024, "sliding_window": None,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    "tiny-qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 1024, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    },
}
# tiny-llama3's first layer: random weights are drawn in checkpoint order, so under the same seed it
# has tiny-llama3's embedding, final norm and layer 0. A draft model for tests.
SHAPES["tiny-llama3-draft"] = {**SHAPES["tiny-llama3"], "num_hidden_layers": 1}


def shape_config(name: str) -> dict[str, Any]:
    """The Hugging Face config dict of a named shape (a copy)."""
    if name not in SHAPES:
        raise ModelLoadError(f"Unknown model shape {name!r}; known shapes: {', '.join(SHAPES)}.")
    return {**SHAPES[name]}
