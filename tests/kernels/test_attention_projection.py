"""o_proj merging decode attention's splits with the add-norm after it
(kernels/attention_projection.py), over float, FP8 and INT4 weights, against dense attention, the
dequantized projection and add_norm_ref, on CPU through Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

import kernels.attention_projection as attention_projection
from kernels.attention_projection import fp8_merge_o_add_norm, int4_merge_o_add_norm, merge_o_add_norm, merges_splits
from kernels.decode_attention import AttentionSplits, decode_attention_splits
from kernels.fp8_linear import quantize_fp8
from kernels.int4_layout import dequantize_int4, pack_int4
from kernels.rmsnorm import add_norm_ref
from kernels.split_k import _TILE_COUNTS
from tests.gpu.shapes import LAYERS
from tests.kernels.conftest import nan_poisoned_allocations
from tests.kernels.test_attention import dense_attention


def o_proj(fmt: str, gen: torch.Generator, hidden: int, inputs: int, dtype: torch.dtype, group_size: int = 16):
    """(merge(splits, residual, norm_weight, eps), the dequantized weight in dtype) for a random weight
    on gen's device (INT4: group_size inputs a group; 16 is two groups a 32-dim head)."""
    device = gen.device
    weight = torch.randn(hidden, inputs, generator=gen, device=device) * inputs**-0.5
    if fmt == "float":
        weight = weight.to(dtype)
        return lambda *a: merge_o_add_norm(a[0], weight, None, *a[1:]), weight
    if fmt == "fp8":
        w8, scale = quantize_fp8(weight)
        return (lambda *a: fp8_merge_o_add_norm(a[0], w8, scale, None, *a[1:]),
                (w8.float() * scale[:, None]).to(dtype))
    groups = inputs // group_size
    q = pack_int4(torch.randint(0, 16, (hidden, inputs), generator=gen, device=device))
    zeros = torch.randint(0, 16, (hidden, groups), generator=gen, device=device).to(torch.float16)
    scales = (torch.rand(hidden, groups, generator=gen, device=device) * 0.02 + 0.005).to(torch.float16)
    return (lambda *a: int4_merge_o_add_norm(a[0], q, zeros, scales, group_size, None, *a[1:]),
            dequantize_int4(q, zeros.float(), scales.float(), group_size).to(dtype))  # exact, as the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt, heads, kv_heads", [("float", 8, 2), ("float", 6, 1), ("float", 9, 3), ("fp8", 8, 2),
                                                  ("int4", 9, 3), ("int4-group-loads", 9, 3)])
@pytest.mark.parametrize("seq_len, fresh, chunk_values", [(1, 0, 8192), (23, 22, 8192), (300, 299, 8192),
                                                          (300, 295, 256)],
                         ids=["one-key", "one-tile", "five-splits", "verify-rows-in-chunks"])
def test_merge_o_add_norm_matches_reference(triton_interpreter, monkeypatch, fmt, dtype, heads, kv_heads, seq_len,
                                            fresh, chunk_values) -> None:
    monkeypatch.setattr(attention_projection, "MERGE_ROWS", 32)  # 80 outputs: two whole row tiles and a part
    monkeypatch.setattr(attention_projection, "CHUNK_VALUES", chunk_values)  # 256: two splits a chunk
    if fmt.startswith("int4"):  # each side of the loads' rule; two groups a 32-dim head (group size 16)
        monkeypatch.setattr(attention_projection, "INT4_GROUP_LOADS_WORDS", 0 if fmt == "int4-group-loads" else 1 << 40)
        fmt = "int4"
    gen = torch.Generator().manual_seed(seq_len + heads)
    dim, block_size, num_blocks, hidden, num_splits = 32, 4, 96, 80, 6
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: -(-seq_len // block_size)].tolist()
    block_table = torch.tensor([table + [10**6] * 2], dtype=torch.int32)  # entries past the end are never read
    q = torch.randn(1, heads, dim, generator=gen).to(dtype)
    merge, weight = o_proj(fmt, gen, hidden, heads * dim, dtype)
    residual = torch.randn(1, hidden, generator=gen).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    lens, first_new = torch.tensor([seq_len], dtype=torch.int32), torch.tensor([fresh], dtype=torch.int32)
    with nan_poisoned_allocations():
        splits = decode_attention_splits(q, k_cache, v_cache, block_table, lens, dim**-0.5, num_splits, first_new)
        out, h, scale = merge(splits, residual, norm_weight, 1e-6)
    keys, values = k_cache[table].flatten(0, 1)[:seq_len], v_cache[table].flatten(0, 1)[:seq_len]
    attn = dense_attention(q, keys, values, dim**-0.5).to(dtype).reshape(1, -1)
    ref_out, ref_h, ref_scale = add_norm_ref(torch.nn.functional.linear(attn, weight), residual, norm_weight, 1e-6)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(h, ref_h, **tol)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(scale.factor(hidden), ref_scale.factor(hidden), **tol)
    torch.testing.assert_close(splits.merged(), attn, **tol)  # the merge kernel, for o_proj that does not merge
    assert not _TILE_COUNTS[torch.device("cpu")].any()  # the groups' arrival counters are back at zero


def test_only_one_row_whose_partials_fit_merges_in_o_proj(monkeypatch) -> None:
    def splits(batch: int, heads: int, num_splits: int, head_dim: int) -> AttentionSplits:
        return AttentionSplits(torch.zeros(batch, heads, num_splits, head_dim), torch.zeros(batch, heads, num_splits),
                               torch.ones(batch, dtype=torch.int32), 8, 64, torch.bfloat16)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llama_1b, llama_8b = torch.zeros(2048, 2048), torch.zeros(4096, 4096)
    assert merges_splits(splits(1, 32, 32, 64), 2048, llama_1b)  # 32 row tiles re-read 8 MB of partials
    assert not merges_splits(splits(1, 32, 32, 128), 4096, llama_8b)  # 64 row tiles, 32 MB
    assert not merges_splits(splits(2, 32, 32, 64), 2048, llama_1b)
    assert not merges_splits(splits(1, 32, 32, 64), 2048, llama_1b.t())


@pytest.mark.parametrize("model, group_loads", [("qwen2.5-0.5b", True), ("llama-3.2-1b", False)])
def test_int4_group_loads_go_to_the_blocks_that_spilled_per_word(monkeypatch, model, group_loads) -> None:
    """The INT4 merge-o loads zero points and scales once a group only from INT4_GROUP_LOADS_WORDS
    words a block: the 0.5B shape's (7 heads a KV group, 64 rows x 8 x 8 words), not the 1B's (4)."""
    cfg = LAYERS[model]
    heads, kv_heads, dim, hidden = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    launches = []

    class Kernel:  # records the launch instead of running it
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)
    monkeypatch.setattr(attention_projection, "_merge_o_kernel", Kernel())
    splits = AttentionSplits(torch.zeros(1, heads, 8, dim), torch.zeros(1, heads, 8), torch.tensor([100]), kv_heads,
                             64, torch.float16)
    groups = heads * dim // 128
    scales = torch.ones(hidden, groups, dtype=torch.float16)
    int4_merge_o_add_norm(splits, torch.zeros(hidden, heads * dim // 8, dtype=torch.int32), scales.clone(), scales,
                          128, None, torch.zeros(1, hidden, dtype=torch.float16), scales[:, 0].clone(), 1e-6)
    assert [k["GROUP_LOADS"] for k in launches] == [group_loads]
