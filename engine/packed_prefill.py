"""Whole token sequences through the decoder, outside the engine: no scheduler and no prefix cache,
just one prefill per sequence into a scratch KV cache. Calibration (engine/quantization/) and the
perplexity benchmark (bench/perplexity.py) use it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.llama import DecoderModel
from kernels.attention import AttentionMetadata


@dataclass
class PackedSequences:
    """Sequences back to back in one batch, each with its own blocks of a scratch KV cache."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim]


def pack_sequences(model: DecoderModel, sequences: list[list[int]], num_layers: int | None = None,
                   block_size: int = 16) -> PackedSequences:
    """The inputs of one prefill of every sequence; KV for `num_layers` layers (default: all)."""
    cfg = model.cfg
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    lengths = [len(s) for s in sequences]
    blocks = [-(-n // block_size) for n in lengths]
    first = [sum(blocks[:b]) for b in range(len(blocks))]
    tables = [list(range(f, f + n)) for f, n in zip(first, blocks)]
    slots = [f * block_size + p for f, n in zip(first, lengths) for p in range(n)]
    meta = AttentionMetadata.from_host(slots, lengths, lengths, tables, model.num_kv_heads, device)
    if model.cos_sin is None or model.cos_sin.shape[0] < max(lengths):
        model.init_rope(max(lengths))
    kv = torch.zeros(num_layers or cfg.num_layers, 2, sum(blocks), block_size, model.num_kv_heads, cfg.head_dim,
                     dtype=dtype, device=device)
    return PackedSequences(
        input_ids=torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=device),
        positions=torch.tensor([p for n in lengths for p in range(n)], dtype=torch.int64, device=device),
        meta=meta,
        kv_cache=kv,
    )


@torch.inference_mode()
def sequence_logprobs(model: DecoderModel, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, the float32 log-probability of each of its tokens after the first, given the
    ones before it (one prefill for all of them)."""
    batch = pack_sequences(model, sequences)
    hidden = model(batch.input_ids, batch.positions, batch.kv_cache, batch.meta)
    out, start = [], 0
    for seq in sequences:  # one sequence's logits at a time: a vocabulary-wide row per token is big
        logprobs = torch.log_softmax(model.compute_logits(hidden[start:start + len(seq) - 1]), dim=-1)
        start += len(seq)
        targets = torch.tensor(seq[1:], dtype=torch.int64, device=logprobs.device)
        out.append(logprobs.gather(1, targets[:, None])[:, 0])
    return out


@torch.inference_mode()
def prompt_logits(model: DecoderModel, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [len, vocab] of one sequence; row i scores the token after token i."""
    batch = pack_sequences(model, [token_ids])
    return model.compute_logits(model(batch.input_ids, batch.positions, batch.kv_cache, batch.meta))
