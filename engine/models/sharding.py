"""Which slice of each sharded dimension a tensor-parallel rank holds.

Attention splits by KV head: each rank takes a contiguous run of KV heads (uneven when they do not
divide, e.g. SmolLM2's 3 over 2 ranks) and the query heads of their groups. With fewer KV heads than
ranks, ranks that share a KV head each hold a copy of it and split its query heads. The MLP splits
its intermediate features, and the vocabulary splits into equal runs of rows (the last padded).
With one rank every slice is the whole dimension.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ModelLoadError
from engine.models.config import ModelConfig, QuantConfig


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """(first, count) of part `index` when `total` units split into `parts` contiguous runs, the
    first `total % parts` runs one unit longer."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


@dataclass(frozen=True)
class ModelShard:
    """Slices are (first, count): heads, intermediate features, vocabulary rows."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab_rows: tuple[int, int]  # (first row, rows per rank): the last rank's run may pass the vocabulary

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int, quant: QuantConfig | None = None) -> "ModelShard":
        heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
        if kv_heads >= size:
            kv = split(kv_heads, size, rank)
            group = heads // kv_heads
            q = (kv[0] * group, kv[1] * group)
        elif size % kv_heads == 0 and heads % size == 0:
            kv = (rank // (size // kv_heads), 1)  # replicated: size / kv_heads ranks share each KV head
            q = (rank * (heads // size), heads // size)
        else:
            raise ModelLoadError(f"{kv_heads} KV heads and {heads} query heads cannot be split over "
                                 f"{size} ranks: use a tensor-parallel size that divides both or that they divide.")
        # AWQ packs 8 output features per int32 and scales groups of input features: the
        # intermediate split (down_proj's input) keeps whole groups, and the heads' split must too.
        align = quant.group_size if quant is not None and quant.method == "awq" else 1
        if cfg.intermediate_size % align or (q[1] * cfg.head_dim) % align:
            raise ModelLoadError(f"AWQ groups of {align} do not split evenly over {size} ranks.")
        first, count = split(cfg.intermediate_size // align, size, rank)
        rows = -(-cfg.vocab_size // size)
        return cls(q, kv, (first * align, count * align), (rank * rows, rows))

    def projection(self, kind: str, cfg: ModelConfig) -> tuple[int, int, int]:
        """How a checkpoint projection is cut for this rank: (dim of its [out, in] weight, first, count).
        Column-parallel projections cut output features, row-parallel ones input features."""
        d = cfg.head_dim
        q, kv, inter = (self.q_heads[0] * d, self.q_heads[1] * d), (self.kv_heads[0] * d, self.kv_heads[1] * d), self.intermediate
        return {
            "self_attn.q_proj": (0, *q), "self_attn.k_proj": (0, *kv), "self_attn.v_proj": (0, *kv),
            "self_attn.o_proj": (1, *q), "mlp.gate_proj": (0, *inter), "mlp.up_proj": (0, *inter),
            "mlp.down_proj": (1, *inter),
        }[kind]
