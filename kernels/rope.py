"""Rotary position embedding, fused with writing the new keys and values into the paged KV cache."""
from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies (float32), with llama3 or linear scaling, as Hugging Face computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32 table: cos in the first half, sin in the second."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin: [T, 1, D] already in x's dtype (Hugging Face's rotate_half form).
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Torch reference. q: [T, H, D], k/v: [T, KV, D]; caches: [num_blocks, block_size, KV, D].

    Rotates q and k, writes k and v at their slots, returns the rotated q.
    """
    half = cos_sin.shape[-1] // 2
    table = cos_sin[positions]
    cos = torch.cat([table[:, :half], table[:, :half]], dim=-1)[:, None, :].to(q.dtype)
    sin = torch.cat([table[:, half:], table[:, half:]], dim=-1)[:, None, :].to(q.dtype)
    q = _rotate(q, cos, sin)
    k = _rotate(k, cos, sin)
    num_kv, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv, head_dim)[slot_mapping] = v.to(v_cache.dtype)
    return q


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """RoPE + KV-cache write; dispatches to the best implementation for the device."""
    return rope_store_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
