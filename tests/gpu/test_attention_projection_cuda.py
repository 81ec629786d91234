"""o_proj merging decode attention's splits (kernels/attention_projection.py), over float, FP8 and
INT4 weights, against the merge kernel, the dequantized F.linear and add_norm_ref on a CUDA GPU, at
the Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B head and hidden shapes, outputs poisoned (run
through the device tool; skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

import kernels.attention_projection as attention_projection
from kernels.attention import AttentionMetadata
from kernels.decode_attention import decode_attention_splits
from kernels.rmsnorm import add_norm_ref
from tests.gpu.shapes import LAYERS
from tests.gpu.test_kernels_cuda import rel_err
from tests.kernels.conftest import nan_poisoned_allocations
from tests.kernels.test_attention_projection import o_proj

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK_SIZE, NUM_BLOCKS = 16, 1024


@pytest.mark.parametrize("fmt", ["float", "fp8", "int4", "int4-group-loads"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model", LAYERS)
@pytest.mark.parametrize("seq_len", [1, 130, 2049, 8192])
def test_merge_o_add_norm(monkeypatch, fmt, dtype, model, seq_len) -> None:
    # The 8B shape's partials are over MAX_PARTIAL_READS, so the engine merges them apart; the
    # kernel must still be right there.
    monkeypatch.setattr(attention_projection, "MAX_PARTIAL_READS", 1 << 40)
    if fmt.startswith("int4"):  # each side of the zero points' and scales' loads, at every shape
        monkeypatch.setattr(attention_projection, "INT4_GROUP_LOADS_WORDS", 0 if fmt == "int4-group-loads" else 1 << 40)
        fmt = "int4"
    layer = LAYERS[model]
    hidden, heads, kv_heads, head_dim = layer.hidden_size, layer.num_heads, layer.num_kv_heads, layer.head_dim
    gen = torch.Generator(device="cuda").manual_seed(seq_len)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    table = torch.randperm(NUM_BLOCKS)[: -(-seq_len // BLOCK_SIZE)].tolist()
    meta = AttentionMetadata.from_host([0], [1], [seq_len], [table], kv_heads, torch.device("cuda"))
    q = torch.randn(1, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    merge, weight = o_proj(fmt, gen, hidden, heads * head_dim, dtype, group_size=128)
    residual = torch.randn(1, hidden, device="cuda", dtype=dtype, generator=gen)
    norm_weight = 1 + 0.1 * torch.randn(hidden, device="cuda", dtype=dtype, generator=gen)
    with nan_poisoned_allocations():
        splits = decode_attention_splits(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, head_dim**-0.5,
                                         meta.num_splits)
        out, h, scale = merge(splits, residual, norm_weight, 1e-5)
        attn = splits.merged()
    ref_out, ref_h, ref_scale = add_norm_ref(torch.nn.functional.linear(attn, weight), residual, norm_weight, 1e-5)
    assert rel_err(h, ref_h) < 1e-2 and rel_err(out, ref_out) < 1e-2
    assert rel_err(scale.factor(hidden), ref_scale.factor(hidden)) < 1e-2
