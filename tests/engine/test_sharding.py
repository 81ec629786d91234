"""Tensor-parallel shards: which heads and features each rank holds, and that each rank's loaded
weights are exactly its slices of the whole model's (float and AWQ checkpoints). Loading runs no
collective, so every rank's shard is built here in one process."""
from __future__ import annotations

import pytest
import torch

from engine.distributed import TensorParallel
from engine.errors import ModelLoadError
from engine.loader import load_model, model_config
from engine.models.config import ModelConfig, QuantConfig
from engine.models.linear import Fp8Linear, Int4Linear
from engine.models.llama import DecoderModel
from engine.models.shapes import shape_config
from engine.models.sharding import ModelShard, split
from tests.engine.quantization.conftest import _float_and_awq_by_hand

CPU = torch.device("cpu")


def _cfg(heads: int, kv_heads: int, **overrides) -> ModelConfig:
    hf = shape_config("llama-3.2-1b") | {"num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                         "head_dim": 64} | overrides
    return ModelConfig.from_hf(hf)


def test_split_covers_the_whole_dimension_in_order() -> None:
    for total, parts in ((3, 2), (8, 2), (7, 3), (128, 8)):
        runs = [split(total, parts, i) for i in range(parts)]
        assert runs[0][0] == 0 and sum(n for _, n in runs) == total
        assert all(a + n == b for (a, n), (b, _) in zip(runs, runs[1:]))
        assert max(n for _, n in runs) - min(n for _, n in runs) <= 1
    assert [split(3, 2, i) for i in range(2)] == [(0, 2), (2, 1)]


def test_uneven_kv_heads_take_their_query_groups() -> None:
    cfg = model_config("random:smollm2-135m")  # 9 query heads in 3 groups of 3, intermediate 1536
    shards = [ModelShard.of(cfg, r, 2) for r in range(2)]
    assert [(s.q_heads, s.kv_heads) for s in shards] == [((0, 6), (0, 2)), ((6, 3), (2, 1))]
    assert [s.intermediate for s in shards] == [(0, 768), (768, 768)]
    assert [s.vocab_rows for s in shards] == [(0, 24576), (24576, 24576)]


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    cfg = _cfg(32, 8)
    shards = [ModelShard.of(cfg, r, 16) for r in range(16)]
    assert [s.kv_heads for s in shards] == [(r // 2, 1) for r in range(16)]
    assert [s.q_heads for s in shards] == [(2 * r, 2) for r in range(16)]
    # Each rank's query heads belong to its KV head's group of 4.
    assert all(s.q_heads[0] // 4 == s.kv_heads[0] for s in shards)


@pytest.mark.parametrize(("heads", "kv_heads", "size", "quant", "message"), [
    (9, 3, 4, "", "cannot be split over 4 ranks"),
    (9, 3, 2, "awq", "AWQ groups of 128 do not split evenly"),  # 3 query heads of 64: 192 features
])
def test_splits_that_cannot_be_made_are_refused(heads, kv_heads, size, quant, message) -> None:
    q = QuantConfig("awq", group_size=128) if quant else None
    with pytest.raises(ModelLoadError, match=message):
        for rank in range(size):
            ModelShard.of(_cfg(heads, kv_heads), rank, size, q)


def _dense(module: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight as float [out, in], whatever its format."""
    if isinstance(module, Int4Linear):
        return module.dequantize().float()
    if isinstance(module, Fp8Linear):
        return module.weight.float() * module.weight_scale[:, None]
    return module.weight.float()


def _expected_shard(full: DecoderModel, shard: ModelShard, layer: int) -> dict[str, torch.Tensor]:
    """A rank's weights cut by hand from the whole model's."""
    cfg, d = full.cfg, full.cfg.head_dim
    q_all, kv_all, inter_all = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    (qh, qn), (kh, kn), (i0, ni) = shard.q_heads, shard.kv_heads, shard.intermediate
    lay = full.layers[layer]
    qkv, gate_up = _dense(lay.qkv_proj), _dense(lay.gate_up_proj)
    return {
        "qkv_proj": torch.cat([qkv[qh * d:(qh + qn) * d], qkv[q_all + kh * d:q_all + (kh + kn) * d],
                               qkv[q_all + kv_all + kh * d:q_all + kv_all + (kh + kn) * d]]),
        "o_proj": _dense(lay.o_proj)[:, qh * d:(qh + qn) * d],
        "gate_up_proj": torch.cat([gate_up[i0:i0 + ni], gate_up[inter_all + i0:inter_all + i0 + ni]]),
        "down_proj": _dense(lay.down_proj)[:, i0:i0 + ni],
    }


def _check_shards(path, size: int) -> None:
    full = load_model(path, torch.float32, CPU)
    vocab = full.cfg.vocab_size
    for rank in range(size):
        part = load_model(path, torch.float32, CPU, tp=TensorParallel(rank, size))
        for i, layer in enumerate(part.layers):
            for name, expected in _expected_shard(full, part.shard, i).items():
                torch.testing.assert_close(_dense(getattr(layer, name)), expected, rtol=0, atol=0)
            if layer.qkv_proj.bias is not None:  # Qwen2: the bias follows its rows
                assert layer.qkv_proj.bias.shape[0] == layer.qkv_proj.out_features
        first, rows = part.shard.vocab_rows
        count = min(rows, vocab - first)
        heads = [("embed_tokens", part.embed_tokens.weight, full.embed_tokens.weight)]
        if full.lm_head is not None:
            heads.append(("lm_head", part.lm_head.weight, full.lm_head.weight))
        for _, mine, whole in heads:
            assert torch.equal(mine[:count], whole[first:first + count])
            assert not mine[count:].any()  # padding rows stay zero: their logits are cut off


@pytest.mark.parametrize(("shape", "size"), [("tiny-llama3", 2), ("tiny-qwen2", 2), ("tiny-mistral", 4)])
def test_each_rank_loads_exactly_its_slices(tiny_model_dir, shape, size) -> None:
    # tiny-mistral has one KV head: four ranks each hold a copy of it and one query head.
    _check_shards(tiny_model_dir(shape, vocab_size=509)[0], size)  # a vocabulary two ranks do not divide


def test_each_rank_loads_exactly_its_awq_slices(tiny_model_dir, tmp_path) -> None:
    _, awq_dir = _float_and_awq_by_hand(tiny_model_dir("tiny-llama3")[0], tmp_path)
    _check_shards(awq_dir, 2)


def test_kv_bytes_per_token_count_this_ranks_heads() -> None:
    with torch.device("meta"):
        whole = DecoderModel(model_config("random:smollm2-135m"), torch.bfloat16)
        first = DecoderModel(model_config("random:smollm2-135m"), torch.bfloat16, tp=TensorParallel(0, 2))
    assert whole.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2
    assert first.kv_bytes_per_token() == 2 * 30 * 2 * 64 * 2
