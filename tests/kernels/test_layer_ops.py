"""RMSNorm, RoPE + KV write and SiLU·mul references against transformers' own layers."""
from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kernels.activation import silu_mul
from kernels.rmsnorm import rms_norm
from kernels.rope import rope_cos_sin, rope_inv_freq, rope_store_kv


def test_fused_add_rms_norm_matches_transformers() -> None:
    x, residual, weight = torch.randn(5, 64), torch.randn(5, 64), torch.rand(64) + 0.5
    norm = LlamaRMSNorm(64, eps=1e-5)
    norm.weight.data.copy_(weight)
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(out, norm(residual + x))


def test_rope_matches_transformers_and_writes_kv_at_slots() -> None:
    heads, kv_heads, dim, tokens = 4, 2, 16, 6
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    inv_freq = rope_inv_freq(dim, 500000.0, scaling)
    positions = torch.tensor([0, 1, 2, 40, 41, 200])
    q, k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    k_cache, v_cache = torch.full((8, 4, kv_heads, dim), float("nan")), torch.full((8, 4, kv_heads, dim), float("nan"))
    slots = torch.tensor([5, 6, 7, 12, 13, 30])
    q_out = rope_store_kv(q, k, v, positions, rope_cos_sin(inv_freq, 256), k_cache, v_cache, slots)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0)
    torch.testing.assert_close(q_out, q_ref.transpose(0, 1))
    torch.testing.assert_close(k_cache.view(-1, kv_heads, dim)[slots], k_ref.transpose(0, 1))
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], v)
    written = torch.zeros(32, dtype=torch.bool)
    written[slots] = True
    assert torch.isnan(k_cache.view(-1, kv_heads, dim)[~written]).all()  # nothing else touched


def test_silu_mul() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(silu_mul(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])
