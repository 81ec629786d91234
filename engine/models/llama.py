"""One decoder for the Llama family: Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM2.

QKV and gate/up are single merged projections (the loader fills their slices), and every op that
gets a Triton kernel goes through kernels/. With a quantization format the seven linear layers of
each decoder layer hold int4 (AWQ) or FP8 weights; embeddings, norms and lm_head keep the model's dtype
(lm_head is int4 too where an AWQ checkpoint's quantization_config says `lm_head: true`).

Under tensor parallelism (engine.distributed) each rank builds the same decoder over its shard
(engine.models.sharding): QKV and gate/up are column-parallel, o_proj and down_proj row-parallel
with an all-reduce, the embedding and lm_head split the vocabulary.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed import SINGLE, TensorParallel
from engine.errors import ModelLoadError
from engine.models.config import ModelConfig, QuantConfig
from engine.models.linear import Linear, Projection, make_linear
from engine.models.sharding import ModelShard
from kernels.attention import AttentionMetadata, paged_attention
from kernels.decode_attention import AttentionSplits
from kernels.embedding import embed_rms_norm, resolve_placeholders
from kernels.float_linear import PackedWeight, dense
from kernels.rmsnorm import NormScale, rms_norm
from kernels.rope import RopeKV, rope_cos_sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantConfig | None = None,
                 shard: ModelShard | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        shard = shard or ModelShard.of(cfg, 0, 1)
        self.tp = tp
        # This rank's heads and intermediate features (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads, self.head_dim = shard.q_heads[1], shard.kv_heads[1], cfg.head_dim
        self.intermediate_size = shard.intermediate[1]
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.input_layernorm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype))
        self.qkv_proj = make_linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.qkv_bias, dtype, quant)
        self.o_proj = make_linear(q_size, cfg.hidden_size, False, dtype, quant)
        self.post_attention_layernorm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype))
        self.gate_up_proj = make_linear(cfg.hidden_size, 2 * self.intermediate_size, False, dtype, quant)
        self.down_proj = make_linear(self.intermediate_size, cfg.hidden_size, False, dtype, quant)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, norm_in: NormScale | None,
                residual: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, cos_sin: torch.Tensor,
                next_norm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
        """hidden is this layer's normalized input, up to norm_in's factor where the projection before
        folded the norm into its epilogue (None: exactly); returns the same for the next layer,
        normalized by next_norm, with the new residual (next_norm None: the last layer's output,
        not yet added to the residual or normalized). Whether a norm folds is the projections'
        choice (one row on a one-row kernel: decode at batch 1), so this is every batch's path."""
        attn = self.attend(positions, hidden, kv_cache, meta, cos_sin, norm_in, keep_splits=self.tp.size == 1)
        hidden, residual, norm_in = self.add_norm(self.o_proj, attn, residual, self.post_attention_layernorm)
        hidden = self.gate_up_proj(hidden, silu_mul=True, norm_in=norm_in)
        if next_norm is None:
            return self.tp.all_reduce(self.down_proj(hidden)), residual, None
        return self.add_norm(self.down_proj, hidden, residual, next_norm)

    def add_norm(self, proj: Projection, x: torch.Tensor | AttentionSplits, residual: torch.Tensor,
                 norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
        """A row-parallel projection, the residual add and the next RMSNorm (Projection.add_norm)."""
        if self.tp.size > 1:  # the all-reduce goes between the projection and the residual add
            return (*rms_norm(self.tp.all_reduce(proj(x)), norm_weight, self.eps, residual), None)
        return proj.add_norm(x, residual, norm_weight, self.eps)

    def self_attention(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        """Normalized hidden states in, o_proj's output out (the new keys and values go to kv_cache):
        the attention block alone, which calibration (engine/quantization) searches over."""
        return self.tp.all_reduce(self.o_proj(self.attend(positions, hidden, kv_cache, meta, cos_sin)))

    def mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalized hidden states in, down_proj's output out: the MLP block alone, which AWQ
        searches over."""
        return self.tp.all_reduce(self.down_proj(self.gate_up_proj(hidden, silu_mul=True)))

    def attend(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               cos_sin: torch.Tensor, norm_in: NormScale | None = None, keep_splits: bool = False
               ) -> torch.Tensor | AttentionSplits:
        """QKV, RoPE and attention: o_proj's input [tokens, q heads * head_dim], or with keep_splits
        decode attention's splits unmerged, which o_proj merges (Projection.add_norm)."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        rope = RopeKV(positions, cos_sin, k_cache, v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads,
                      self.head_dim)
        q = self.qkv_proj.rope_store_kv(hidden, norm_in, rope)
        attn = paged_attention(q, k_cache, v_cache, meta, self.scale, keep_splits)
        return attn if isinstance(attn, AttentionSplits) else attn.reshape(hidden.shape[0], -1)


class DecoderModel(nn.Module):
    """Token ids in, hidden states out; `compute_logits` turns chosen rows into logits (float32 unless asked).

    `quant` is the format of the linear weights: the checkpoint's (cfg.quantization) by default, or
    FP8 for a float checkpoint quantized as it loads."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantConfig | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.quant = quant or cfg.quantization
        self.tp = tp
        self.shard = ModelShard.of(cfg, tp.rank, tp.size, self.quant)
        self.num_kv_heads = self.shard.kv_heads[1]  # this rank's: the KV cache holds only these
        rows = self.shard.vocab_rows[1]
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size, _weight=torch.empty(rows, cfg.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, self.quant, self.shard, tp) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype))
        self.lm_head: nn.Module | None = None  # None: tied to the embedding
        if self.quant is not None and self.quant.lm_head:
            if tp.size > 1:
                raise ModelLoadError("An int4 lm_head (quantization_config lm_head: true) is served on one GPU only; "
                                     "use --tensor-parallel-size 1 or a checkpoint with a float lm_head.")
            self.lm_head = make_linear(cfg.hidden_size, rows, False, dtype, self.quant)
        elif not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False, dtype=dtype)
        # Filled by the loader: arithmetic on the meta device would import torch._dynamo, slowly.
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.cos_sin: torch.Tensor | None = None  # built for max_model_len by init_rope()
        self.head_packed: PackedWeight | None = None  # pack_weights' copy of the float lm_head (or the tied embedding)

    def kv_bytes_per_token(self) -> int:
        """KV bytes a token takes on this rank (its KV heads only)."""
        return self.cfg.kv_bytes_per_token(self.embed_tokens.weight.element_size(), self.num_kv_heads)

    def init_rope(self, max_positions: int) -> None:
        """Precompute the cos/sin table on the model's device (after weights are in place)."""
        self.cos_sin = rope_cos_sin(self.inv_freq.float().cpu(), max_positions).to(self.inv_freq.device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
        prev_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]. With prev_tokens
        (the step in flight's sampled ids), input_ids may name them by placeholder (-1 - row)."""
        assert self.cos_sin is not None, "call init_rope() first"
        eps = self.cfg.rms_norm_eps
        if self.tp.size == 1:  # one kernel: placeholders, embedding and the first norm
            hidden, residual = embed_rms_norm(input_ids, prev_tokens, self.embed_tokens.weight,
                                              self.layers[0].input_layernorm, eps)
        else:
            ids = input_ids if prev_tokens is None else resolve_placeholders(input_ids, prev_tokens)
            hidden, residual = rms_norm(self.embed(ids), self.layers[0].input_layernorm, eps)
        norm_in = None
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
            hidden, residual, norm_in = layer(positions, hidden, norm_in, residual, kv_cache[i], meta, self.cos_sin,
                                              next_norm)
        hidden, _ = rms_norm(hidden, self.norm, eps, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        # Vocabulary-parallel: each rank looks up the ids in its rows, zeros the others, and the sum
        # over ranks is the embedding.
        first, rows = self.shard.vocab_rows
        local = input_ids - first
        mine = (local >= 0) & (local < rows)
        hidden = self.embed_tokens(local.clamp(0, rows - 1)) * mine.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(hidden)

    def pack_weights(self, rows: int) -> None:
        """Keep MKL-packed copies of the float32 weights for CPU steps of up to `rows` rows (verify
        steps; kernels/float_linear.py's PackedWeight): about the weights' bytes again."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.packed = PackedWeight.of(module.weight, rows)
        if self.lm_head is None or isinstance(self.lm_head, nn.Linear):  # not an int4 lm_head
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.head_packed = PackedWeight.of(head, rows)

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Logits [rows, vocab] of hidden rows, as `dtype` (None: the model's own, a view)."""
        if self.head_packed is not None:
            logits = dense(hidden, self.head_packed.weight, packed=self.head_packed)
        elif self.lm_head is None:
            logits = torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        logits = self.tp.all_gather(logits)
        logits = logits[:, : self.cfg.vocab_size]
        return logits if dtype is None else logits.to(dtype)
