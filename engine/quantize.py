"""Weight-only quantization of a float checkpoint (`minillm quantize`): int4 in AutoAWQ's GEMM layout,
or FP8 in compressed-tensors' layout.

For int4, every group of G consecutive input features of an output feature gets its own 16-level affine grid:
scale = (max - min) / 15, an integer zero point in 0..15, each weight rounded to its nearest level.

  rtn  that grid on the weights as they are.
  awq  activation-aware weight quantization (Lin et al., "AWQ", MLSys 2024), as AutoAWQ does it: run
       a calibration text (engine/data/calibration.txt: the Declaration of Independence and the
       Articles of Confederation) through the float model, layer by layer.
       For each linear layer's input take the mean |activation| per input feature and grid-search
       alpha in [0, 1) for per-feature scales s = mean|x|^alpha / mean|w|^(1 - alpha) (normalized;
       no scaling is a candidate too) minimizing the squared error of the block's output computed
       with Q(W * s) on x / s: the attention block's for QKV, the MLP's for gate/up, their own for
       o_proj and down_proj. 1/s is folded into the op before (input_layernorm for QKV,
       post_attention_layernorm for gate/up, up_proj's rows for down_proj, v_proj's rows for o_proj
       unless grouped-query attention shares v rows between heads, where AutoAWQ skips it too), so
       the float model computes the same. Then each group's range is clipped (not for q/k) where
       that lowers the error of the group's partial dot products on the calibration activations.
       Each layer is searched on the activations the original float model feeds it. Then the
       weights are rounded onto those groups' grids by GPTQ (below) instead of to nearest, layer
       by layer, each layer's Hessians from the quantized layers before it (SmolLM2, perplexity
       against AWQ rounding to nearest: 10.14 against 10.78 at group size 64, 9.13 against 9.57
       at 32; the same at 16). Last, the group scales and RMSNorm weights are tuned end to end
       against the float model's next-token distributions on the calibration text, the levels
       fixed (tune_end_to_end; SmolLM2 at group size 32: 9.13 → 8.73 with the Declaration alone as
       the calibration text, 8.31 with the Articles of Confederation after it).
  fp8-gptq  FP8 (e4m3) weights with one scale per output feature (its largest magnitude maps to 448),
       rounded by GPTQ (Frantar et al., ICLR 2023) instead of to nearest: input features are rounded
       one at a time, and each one's rounding error is spread over the features not yet rounded,
       weighted by the inverse Hessian of the layer's squared output error on the calibration text
       (H = 2 X^T X, dampened by 10% of its mean diagonal). Layer by layer, each fed the already
       quantized layers' output.

With --lm-head (int4 only), lm_head is quantized as well, on the final hidden states (awq: clipping
searched, then GPTQ, before the end-to-end tuning, which tunes its scales with the others; rtn: to
nearest), written as `lm_head.qweight/.qzeros/.scales` with `lm_head: true` in quantization_config
(GPTQ's key; AutoAWQ keeps lm_head float). A tied embedding stays float.

The output directory holds model.safetensors (int4: `<proj>.qweight/.qzeros/.scales` like AutoAWQ,
the rest in float16; FP8: `<proj>.weight` in float8_e4m3fn with `<proj>.weight_scale` [N, 1], the rest
in bfloat16), config.json with its quantization_config, and the tokenizer and generation files.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.errors import ModelLoadError
from engine.loader import layer_projections, load_model
from engine.model_store import COMPLETE_MARKER, resolve_model, source_block_size
from engine.models.config import ModelConfig
from engine.models.llama import DecoderLayer, DecoderModel
from engine.packed_prefill import pack_sequences
from engine.tokenizer import Tokenizer
from kernels.dispatch import reference_kernels
from kernels.fp8_linear import FP8, FP8_MAX, quantize_fp8
from kernels.int4_linear import pack_awq

log = logging.getLogger("minillm.quantize")

METHODS = ("awq", "rtn", "fp8-gptq")
INT4_METHODS = ("awq", "rtn")
# The Declaration of Independence, then the Articles of Confederation.
CALIBRATION_TEXT = Path(__file__).parent / "data" / "calibration.txt"
CALIBRATION_TOKENS = 8192  # the default: all of it (5,946 tokens for SmolLM2)
CALIBRATION_SEQ_LEN = 512
MAX_Q = 15  # 4 bits
GRID = 20  # alphas 0, 1/20, ..., 19/20 (AutoAWQ's grid)
GPTQ_DAMP = 0.1  # share of the Hessian's mean diagonal added to it (0.01, GPTQ's default, did worse here)
GPTQ_BLOCK = 128  # input features whose error updates are applied together
CLIP_STEPS = 10  # each end of a group's range shrunk by 0, 5, ..., 45%
TUNE_STEPS = 40  # the end-to-end tuning's most Adam steps (awq)
TUNE_LR = 1e-3  # Adam's step on the scales' and norm weights' relative changes
TUNE_CHECK = 5  # steps between held-out checks
TUNE_PATIENCE = 2  # checks in a row without a new best that end the tuning
TUNE_HELD_OUT = 0.2  # the calibration text's last fifth: the held-out check's text
_WEIGHT_FILES = ("config.json", "model.safetensors.index.json", COMPLETE_MARKER)
Grid = tuple[torch.Tensor, torch.Tensor]  # an int4 weight's scales and zero points, [N, K/G] each


# ---- the grid --------------------------------------------------------------------------------------

def _on_grid(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The levels (0..15) nearest to `values` on the grid (level - zero) * scale (shapes broadcast)."""
    return (torch.round(values / scale) + zero).clamp(0, MAX_Q)


def _levels(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., G] float32 groups → (levels [..., G] in 0..15, scale, zero point) per group, the scale
    rounded to the float16 it is stored as."""
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo).clamp(min=1e-5) / MAX_Q).half().float()
    zero = (-torch.round(lo / scale)).clamp(0, MAX_Q)
    return _on_grid(groups, scale[..., None], zero[..., None]), scale, zero


def fake_quantize(groups: torch.Tensor) -> torch.Tensor:
    """[..., G] float32 groups → the same values quantized to each group's grid and back."""
    levels, scale, zero = _levels(groups)
    return (levels - zero[..., None]) * scale[..., None]


def quantize_weight(weight: torch.Tensor, group_size: int, grid: Grid | None = None) -> dict[str, torch.Tensor]:
    """A float weight [N out, K in] → AutoAWQ's qweight [K, N/8], qzeros [K/G, N/8], fp16 scales [K/G, N],
    on the given grids (scales and zero points [N, K/G]) or on _levels' own."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    if grid is None:
        levels, scale, zero = _levels(groups)
    else:
        scale, zero = grid
        levels = _on_grid(groups, scale[..., None], zero[..., None])
    return {"qweight": pack_awq(levels.reshape(n, k).t().contiguous().cpu()),
            "qzeros": pack_awq(zero.t().contiguous().cpu()), "scales": scale.t().contiguous().half().cpu()}


def _fake_quantize_weight(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = weight.shape
    return fake_quantize(weight.reshape(n, k // group_size, group_size)).reshape(n, k)


def default_group_size(cfg: ModelConfig, source_block: int | None = None) -> int:
    """The block size of the quantized file the float weights were dequantized from, where there is
    one (the embedded SmolLM2: Q4_1, 32; model_store.source_block_size): a group that straddles
    two of its blocks mixes two grids (SmolLM2 awq before end-to-end tuning: 9.13 at 32 against
    10.14 at 64, where 16 gains less, 8.88). Else 128 (the usual), or the largest of 64 and 32 that
    fits every layer."""
    if source_block is not None:
        with contextlib.suppress(ModelLoadError):
            cfg.check_awq_group_size(source_block)
            return source_block
    for size in (128, 64, 32):
        try:
            cfg.check_awq_group_size(size)
            return size
        except ModelLoadError:
            continue
    cfg.check_awq_group_size(32)  # raises, naming the layer that does not fit
    return 32


# ---- AWQ -------------------------------------------------------------------------------------------

def _search_scale(x: torch.Tensor, weight: torch.Tensor, group_size: int,
                  forward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Per-input-feature scales s for `weight` [N, K] (fed x [T, K]) minimizing the squared error of
    forward(Q(W * s) / s) against forward(W)."""
    n, k = weight.shape
    x_mean = x.abs().mean(0)
    w_rel = weight.abs().reshape(n, k // group_size, group_size)
    w_mean = (w_rel / (w_rel.amax(-1, keepdim=True) + 1e-6)).reshape(n, k).mean(0)
    reference = forward(weight)

    def loss(s: torch.Tensor) -> float:
        return (forward(_fake_quantize_weight(weight * s, group_size) / s) - reference).pow(2).mean().item()

    # No scaling (plain round-to-nearest) is a candidate too, so AWQ never does worse on this loss.
    best = torch.ones_like(x_mean)
    best_loss = loss(best)
    for step in range(GRID):
        alpha = step / GRID
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if (current := loss(s)) < best_loss:
            best_loss, best = current, s
    return best


def _search_clip(x: torch.Tensor, weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (output feature, group) clipping range (lo, hi), each [N, K/G], minimizing the mean
    squared error of the group's partial dot product with x: E[(x_g . (Q(w_g) - w_g))^2] = d^T C d
    with C = E[x_g x_g^T], so all calibration tokens count at the cost of one [G, G] matrix per
    group. Unlike AutoAWQ's symmetric clip, each end shrinks on its own (by up to 45%), which also
    moves the grid's integer zero point: the closest 16-level grid, not just a narrower one."""
    n, k = weight.shape
    ng = k // group_size
    xg = x.reshape(-1, ng, group_size).transpose(0, 1)  # [groups, T, group]
    cov = xg.transpose(1, 2) @ xg / x.shape[0]  # [groups, group, group]
    wg = weight.reshape(n, ng, group_size).transpose(0, 1)  # [groups, N, group]
    lo0, hi0 = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    best_err = torch.full(lo0.shape, float("inf"), device=weight.device)
    best_lo, best_hi = lo0.clone(), hi0.clone()
    shrinks = [1 - step / GRID for step in range(CLIP_STEPS)]

    def consider(lo: torch.Tensor, hi: torch.Tensor) -> None:
        nonlocal best_err, best_lo, best_hi
        d = fake_quantize(torch.clamp(wg, lo, hi)) - wg
        err = (torch.bmm(d, cov) * d).sum(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)

    # Coordinate descent, twice over: the low end given the high, then the high given the low
    # (as good as all 100 pairs on SmolLM2, at 40 tries instead of 100).
    for _ in range(2):
        hi = best_hi.clone()
        for a in shrinks:
            consider(torch.where(lo0 < 0, lo0 * a, lo0), hi)
        lo = best_lo.clone()
        for b in shrinks:
            consider(lo, torch.where(hi0 > 0, hi0 * b, hi0))
    return best_lo[..., 0].t(), best_hi[..., 0].t()


def _clip(weight: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, group_size: int) -> None:
    n, k = weight.shape
    groups = weight.view(n, k // group_size, group_size)
    groups.copy_(torch.clamp(groups, lo[..., None], hi[..., None]))


@torch.no_grad()
def _awq_layer(layer: DecoderLayer, cfg: ModelConfig, inputs: dict[str, torch.Tensor], group_size: int,
               clip: bool, attention: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Search and fold one layer's scales, then clip its weights (all from the original weights).
    `attention` runs the layer's attention block on the calibration batch."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    qkv, o, gate_up, down = (layer.qkv_proj.weight, layer.o_proj.weight, layer.gate_up_proj.weight,
                             layer.down_proj.weight)
    x_qkv, x_o, x_mlp, x_down = inputs["qkv_proj"], inputs["o_proj"], inputs["gate_up_proj"], inputs["down_proj"]

    def linear(x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda w: x @ w.t()

    def block(module: torch.nn.Module, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
              ) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(w: torch.Tensor) -> torch.Tensor:
            with _weight(module, w):
                return run(x)
        return forward

    # As in AutoAWQ, QKV is judged by the attention block's output and gate/up by the MLP's (the
    # rest of each block in float); o_proj and down_proj by their own.
    s_qkv = _search_scale(x_qkv, qkv, group_size, block(layer.qkv_proj, attention, x_qkv))
    s_mlp = _search_scale(x_mlp, gate_up, group_size, block(layer.gate_up_proj, layer.mlp, x_mlp))
    s_down = _search_scale(x_down, down, group_size, linear(x_down))
    # Scaling o_proj's inputs means dividing v_proj's rows; with grouped-query attention one v row
    # feeds several o_proj inputs that would need one scale, so AutoAWQ skips it, and so do we.
    s_o = _search_scale(x_o, o, group_size, linear(x_o)) if q == kv else None

    layer.input_layernorm.div_(s_qkv)
    qkv.mul_(s_qkv)
    layer.post_attention_layernorm.div_(s_mlp)
    gate_up.mul_(s_mlp)
    gate_up[inter:].div_(s_down[:, None])
    down.mul_(s_down)
    if s_o is not None:
        qkv[q + kv:].div_(s_o[:, None])
        if layer.qkv_proj.bias is not None:
            layer.qkv_proj.bias[q + kv:].div_(s_o)
        o.mul_(s_o)
        x_o = x_o / s_o
    if clip:  # q and k feed attention scores, where clipping hurts (AutoAWQ leaves them too)
        for weight, x in ((qkv[q + kv:], x_qkv / s_qkv), (o, x_o), (gate_up, x_mlp / s_mlp), (down, x_down / s_down)):
            _clip(weight, *_search_clip(x, weight, group_size), group_size)


@contextlib.contextmanager
def _flush_denormals() -> Iterator[None]:
    """Calibration's CPU matmuls with denormals flushed: tiny activations times tiny weights make
    denormals, which are many times slower on CPUs."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@torch.no_grad()
def _layer_by_layer(model: DecoderModel, sequences: list[list[int]], what: str, feed_changed: bool,
                    change: Callable[[DecoderLayer, dict[str, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]], None]
                    ) -> None:
    """Run the calibration batch through the model one layer at a time: capture the inputs of the
    layer's linear layers, let `change` rewrite the layer (given them and a function running its
    attention block), and feed the next layer this layer's output from after the change
    (feed_changed) or from before it."""
    batch = pack_sequences(model, sequences, num_layers=1)  # one layer's KV at a time
    with _flush_denormals():
        hidden, residual = model.embed_tokens(batch.input_ids), None
        for i, layer in enumerate(model.layers):
            start = time.monotonic()
            inputs: dict[str, torch.Tensor] = {}
            hooks = [getattr(layer, name).register_forward_pre_hook(
                         lambda _m, args, name=name: inputs.__setitem__(name, args[0].float()))
                     for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
            try:
                out = layer(batch.positions, hidden, residual, batch.kv_cache[0], batch.meta, model.cos_sin)
            finally:
                for hook in hooks:
                    hook.remove()
            change(layer, inputs, functools.partial(layer.self_attention, batch.positions, kv_cache=batch.kv_cache[0],
                                                    meta=batch.meta, cos_sin=model.cos_sin))
            if feed_changed:
                out = layer(batch.positions, hidden, residual, batch.kv_cache[0], batch.meta, model.cos_sin)
            hidden, residual = out
            log.info("%s layer %d/%d: %.1f s", what, i + 1, model.cfg.num_layers, time.monotonic() - start)


def awq_calibrate(model: DecoderModel, sequences: list[list[int]], group_size: int, clip: bool = True) -> None:
    """Fold AWQ's scales into a float model in place, and clip its weights, layer by layer. The next
    layer sees the float layer's output, as in AutoAWQ (feeding it the quantized layer's output
    instead did worse here: perplexity 10.3 against 10.0)."""
    _layer_by_layer(model, sequences, "AWQ", False, lambda layer, inputs, attention: _awq_layer(
        layer, model.cfg, inputs, group_size, clip, attention))


@contextlib.contextmanager
def _weight(module: torch.nn.Module, weight: torch.Tensor) -> Iterator[None]:
    """The module computing with another weight, for a while."""
    saved = module.weight.data
    module.weight.data = weight
    try:
        yield
    finally:
        module.weight.data = saved


def calibration_sequences(tokenizer: Tokenizer, max_tokens: int, seq_len: int = CALIBRATION_SEQ_LEN,
                          text: Path | None = None) -> list[list[int]]:
    """The first `max_tokens` tokens of a calibration text (default: the shipped one), in sequences
    of up to seq_len."""
    tokens = tokenizer.encode((text or CALIBRATION_TEXT).read_text(encoding="utf-8"))[:max_tokens]
    sequences = [tokens[i:i + seq_len] for i in range(0, len(tokens), seq_len)]
    return [s for s in sequences if len(s) > 1]


# ---- GPTQ ------------------------------------------------------------------------------------------

def gptq_round(weight: torch.Tensor, hessian: torch.Tensor,
               round_column: Callable[[torch.Tensor, int], torch.Tensor],
               damp: float = GPTQ_DAMP, block: int = GPTQ_BLOCK) -> torch.Tensor:
    """GPTQ: weight [N, K] rounded one input feature (column) at a time by round_column (column k's
    values [N] and k → the nearest representable [N]), each column's error pushed onto the columns after it so as to
    minimize the output error tr((W - Q) H (W - Q)^T) for the layer's input Hessian H [K, K]."""
    w = weight.float().clone()
    h = hessian.float().clone()
    k = w.shape[1]
    dead = torch.diag(h) == 0  # inputs that are always zero: anything goes
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(k, device=h.device)
    # The upper Cholesky factor of H^-1: row i holds how column i's error moves the later columns.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    out = torch.empty_like(w)
    for start in range(0, k, block):
        end = min(start + block, k)
        cols, errors, hb = w[:, start:end].clone(), torch.empty(w.shape[0], end - start, device=w.device), hinv[start:end, start:end]
        for i in range(end - start):
            rounded = round_column(cols[:, i], start + i)
            out[:, start + i] = rounded
            err = (cols[:, i] - rounded) / hb[i, i]
            cols[:, i:] -= err[:, None] * hb[i, i:][None, :]
            errors[:, i] = err
        w[:, end:] -= errors @ hinv[start:end, end:]  # the block's errors onto every later column at once
    return out


def _fp8_gptq(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K] GPTQ-rounded to FP8 with the original rows' scales (fed x [T, K]), dequantized."""
    _, scale = quantize_fp8(weight)

    def nearest(col: torch.Tensor, _k: int) -> torch.Tensor:
        return (col / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale

    return gptq_round(weight, 2 * x.t() @ x / x.shape[0], nearest)


def int4_gptq(weight: torch.Tensor, x: torch.Tensor, group_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] GPTQ-rounded onto its groups' int4 grids (as _levels makes them from the weight
    as it is), fed x [T, K]: (the dequantized weight, the grids' scales and zero points [N, K/G])."""
    n, k = weight.shape
    _, scale, zero = _levels(weight.float().reshape(n, k // group_size, group_size))

    def nearest(col: torch.Tensor, column: int) -> torch.Tensor:
        s, z = scale[:, column // group_size], zero[:, column // group_size]
        return (_on_grid(col, s, z) - z) * s

    return gptq_round(weight, 2 * x.t() @ x / x.shape[0], nearest), scale, zero


def int4_gptq_calibrate(model: DecoderModel, sequences: list[list[int]], group_size: int) -> dict[torch.nn.Module, Grid]:
    """Replace each decoder linear weight by its GPTQ-rounded int4 values (dequantized, in place),
    layer by layer, each layer's Hessians taken from the quantized layers before it. Returns each
    linear module's grids, which the export must use (a group's rounded values need not span its grid)."""
    grids: dict[torch.nn.Module, Grid] = {}

    def change(layer: DecoderLayer, inputs: dict[str, torch.Tensor], _attention: object) -> None:
        for name, x in inputs.items():
            module = getattr(layer, name)
            rounded, scale, zero = int4_gptq(module.weight, x, group_size)
            module.weight.copy_(rounded)
            grids[module] = (scale, zero)

    _layer_by_layer(model, sequences, "GPTQ (int4)", True, change)
    return grids


def lm_head_weight(model: DecoderModel) -> torch.Tensor:
    """The output projection's float weight [V, H]: the embedding's where the two are tied."""
    return model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight


@torch.no_grad()
def int4_lm_head_calibrate(model: DecoderModel, sequences: list[list[int]], group_size: int
                           ) -> tuple[torch.nn.Linear, Grid]:
    """lm_head's weight rounded onto int4 grids as the decoder layers' are (clipping searched, then
    GPTQ), fed the final hidden states of the already quantized decoder on the calibration text:
    (the model's lm_head now holding the rounded weight [V, H], its grids). A tied embedding stays
    float: the model gets an lm_head of its own."""
    batch = pack_sequences(model, sequences)
    with _flush_denormals():
        x = model(batch.input_ids, batch.positions, batch.kv_cache, batch.meta).float()
        weight = lm_head_weight(model).float().clone()
        _clip(weight, *_search_clip(x, weight, group_size), group_size)
        rounded, scale, zero = int4_gptq(weight, x, group_size)
    if model.lm_head is None:
        model.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype,
                                        device=weight.device)
    model.lm_head.weight.copy_(rounded)
    return model.lm_head, (scale, zero)


def fp8_gptq_calibrate(model: DecoderModel, sequences: list[list[int]]) -> None:
    """Replace each decoder linear weight by its GPTQ-rounded FP8 values (dequantized, in place),
    layer by layer, each layer's Hessians taken from the quantized layers before it."""
    def change(layer: DecoderLayer, inputs: dict[str, torch.Tensor], _attention: object) -> None:
        for name, x in inputs.items():
            weight = getattr(layer, name).weight
            weight.copy_(_fp8_gptq(weight, x))

    _layer_by_layer(model, sequences, "GPTQ (FP8)", True, change)


# ---- end-to-end tuning -----------------------------------------------------------------------------

def _next_token_logprobs(model: DecoderModel, sequences: list[list[int]],
                         overrides: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """float32 log-probabilities [tokens, vocab] of the next token at every position of the packed
    sequences, with `overrides` (parameter name → tensor, e.g. one carrying gradients) in place of
    the model's own parameters."""
    batch = pack_sequences(model, sequences)
    args = (batch.input_ids, batch.positions, batch.kv_cache, batch.meta)
    overrides = {f"model.{name}": t for name, t in (overrides or {}).items()}
    with reference_kernels():  # autograd's path; the Triton kernels have no backward
        return torch.log_softmax(torch.func.functional_call(_Logits(model), overrides, args), dim=-1)


class _Logits(torch.nn.Module):
    """The decoder with compute_logits in its forward, so that functional_call's overrides reach lm_head too."""

    def __init__(self, model: DecoderModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: object) -> torch.Tensor:
        return self.model.compute_logits(self.model(*args))


def _kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean KL divergence of `student` from `teacher` over rows of log-probabilities."""
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


@dataclasses.dataclass
class TuningTargets:
    """What the end-to-end tuning fits: the calibration text split into tuning sequences and a
    held-out one (its last fifth), with the float model's next-token log-probabilities on each."""
    tune: list[list[int]]
    held: list[list[int]]
    tune_logprobs: torch.Tensor
    held_logprobs: torch.Tensor


@torch.no_grad()
def tuning_targets(teacher: DecoderModel, sequences: list[list[int]]) -> TuningTargets | None:
    """The float `teacher`'s TuningTargets on the calibration sequences (taken before AWQ changes
    the model, so no second copy of it is kept), or None where the text is too short to split."""
    tokens = [t for seq in sequences for t in seq]
    cut = int(len(tokens) * (1 - TUNE_HELD_OUT))
    if cut < 2 or len(tokens) - cut < 2:
        return None
    tune = [tokens[i:min(i + CALIBRATION_SEQ_LEN, cut)] for i in range(0, cut, CALIBRATION_SEQ_LEN)]
    tune, held = [seq for seq in tune if len(seq) > 1], [tokens[cut:]]
    return TuningTargets(tune, held, _next_token_logprobs(teacher, tune), _next_token_logprobs(teacher, held))


def tune_end_to_end(model: DecoderModel, targets: TuningTargets, grids: dict[torch.nn.Module, Grid],
                    group_size: int, steps: int = TUNE_STEPS) -> None:
    """Tune the int4 model's group scales and RMSNorm weights, its levels and zero points fixed, so
    that its next-token distributions match the float model's (`targets`) over the calibration text
    (KL divergence, Adam on each value's relative change), as norm tweaking and OmniQuant do: GPTQ
    and AWQ fit each layer's own output, this fits what the layers' errors add up to. Every
    TUNE_CHECK steps the held-out text's KL is measured; tuning stops after TUNE_PATIENCE checks in
    a row without a new best (more steps overfit the short text: SmolLM2 at group size 64, eval
    perplexity 9.84 → 9.15 in 20 steps, then 9.28 at 60), and the best values seen are kept
    (SmolLM2 at group size 32, the Declaration alone: held-out KL 0.150 → 0.134 at 5 steps, then
    up; eval perplexity 9.13 → 8.73; 3.5 times the text, same-domain, 8.31). Updates the modules'
    weights (still on their grids), their `grids` and the norm weights in place."""
    if steps <= 0:
        return
    names = {module: name for name, module in model.named_modules()}
    # Per quantized weight: (name, levels minus zero points [N, K], scales [N, K/G]); per norm: (name, weight).
    weights = [(f"{names[m]}.weight", torch.round(m.weight.detach().float() / s.repeat_interleave(group_size, 1)), s)
               for m, (s, _z) in grids.items()]
    norms = [(name, p.detach().float()) for name, p in model.named_parameters()
             if name == "norm" or name.endswith("layernorm")]
    deltas = [torch.zeros_like(s, requires_grad=True) for _, _, s in weights]
    deltas += [torch.zeros_like(w, requires_grad=True) for _, w in norms]

    def overrides() -> dict[str, torch.Tensor]:
        out = {name: q * (s * (1 + d)).repeat_interleave(group_size, 1) for (name, q, s), d in zip(weights, deltas)}
        return out | {name: w * (1 + d) for (name, w), d in zip(norms, deltas[len(weights):])}

    def held_out_kl() -> float:
        with torch.no_grad():
            return _kl(targets.held_logprobs, _next_token_logprobs(model, targets.held, overrides())).item()

    optimizer = torch.optim.Adam(deltas, lr=TUNE_LR)
    best, best_kl, misses = [d.detach().clone() for d in deltas], held_out_kl(), 0
    log.info("tuning: held-out KL %.4f before", best_kl)
    with _flush_denormals():
        for step in range(1, steps + 1):
            start = time.monotonic()
            loss = _kl(targets.tune_logprobs, _next_token_logprobs(model, targets.tune, overrides()))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            log.info("tuning step %d/%d: KL %.4f (%.1f s)", step, steps, loss.item(), time.monotonic() - start)
            if step % TUNE_CHECK == 0 or step == steps:
                kl = held_out_kl()
                log.info("tuning: held-out KL %.4f after %d steps", kl, step)
                if kl < best_kl:
                    best, best_kl, misses = [d.detach().clone() for d in deltas], kl, 0
                elif (misses := misses + 1) == TUNE_PATIENCE:
                    break
    with torch.no_grad():
        for (module, (_s, zero)), (_name, q, scale), d in zip(grids.items(), weights, best):
            tuned = (scale * (1 + d)).half().float()  # as the checkpoint stores it
            tuned = torch.where(tuned > 0, tuned, scale)
            module.weight.copy_(q * tuned.repeat_interleave(group_size, 1))
            grids[module] = (tuned, zero)
        params = dict(model.named_parameters())
        for (name, w), d in zip(norms, best[len(weights):]):
            params[name].copy_(w * (1 + d))


# ---- the checkpoint --------------------------------------------------------------------------------

def _export(model: DecoderModel, dtype: torch.dtype,
            quantize_projection: Callable[[torch.nn.Module, slice], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face names: each decoder projection (rows `rows` of a linear
    module's weight [N, K]) as the leaves quantize_projection makes of it, everything else in dtype."""
    def plain(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype).cpu().contiguous()

    out = {"model.embed_tokens.weight": plain(model.embed_tokens.weight), "model.norm.weight": plain(model.norm)}
    if model.lm_head is not None:
        out["lm_head.weight"] = plain(model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = plain(layer.input_layernorm)
        out[p + "post_attention_layernorm.weight"] = plain(layer.post_attention_layernorm)
        for name, (module, start, size) in layer_projections(model.cfg, layer).items():
            leaves = quantize_projection(module, slice(start, start + size))
            out |= {f"{p}{name}.{leaf}": t.cpu().contiguous() for leaf, t in leaves.items()}
            if module.bias is not None:
                out[f"{p}{name}.bias"] = plain(module.bias[start:start + size])
    return out


def export_awq(model: DecoderModel, group_size: int, grids: dict[torch.nn.Module, Grid] | None = None,
               lm_head: tuple[torch.Tensor, Grid | None] | None = None) -> dict[str, torch.Tensor]:
    """Decoder linear layers packed in AutoAWQ's GEMM layout (on `grids` where a module has them),
    everything else in float16; with `lm_head` (a weight [V, H] and its grids, or None for its own
    min/max grids), lm_head packed the same way too (the embedding stays float16 even if tied)."""
    def int4(module: torch.nn.Module, rows: slice) -> dict[str, torch.Tensor]:
        grid = (grids or {}).get(module)
        return quantize_weight(module.weight[rows], group_size, None if grid is None else (grid[0][rows], grid[1][rows]))

    tensors = _export(model, torch.float16, int4)
    if lm_head is not None:
        tensors.pop("lm_head.weight", None)
        tensors |= {f"lm_head.{leaf}": t for leaf, t in quantize_weight(lm_head[0], group_size, lm_head[1]).items()}
    return tensors


def export_fp8(model: DecoderModel) -> dict[str, torch.Tensor]:
    """Decoder linear weights in FP8 with a float32 scale per output feature ([N, 1], as
    compressed-tensors writes it), everything else in bfloat16. Weights already on their FP8 grid
    (fp8_gptq_calibrate) come out exactly."""
    def fp8(module: torch.nn.Module, rows: slice) -> dict[str, torch.Tensor]:
        weight, scale = quantize_fp8(module.weight[rows])
        return {"weight": weight, "weight_scale": scale[:, None]}

    return _export(model, torch.bfloat16, fp8)


def fp8_quantization_config() -> dict:
    """compressed-tensors' FP8 scheme with per-channel weights (activations: dynamic per token, as
    minillm's prefill on Hopper does them)."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True,
                            "dynamic": False},
                "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True,
                                      "dynamic": True}}}}


def awq_quantization_config(group_size: int, lm_head: bool = False) -> dict:
    """AutoAWQ's config; `lm_head: true` (GPTQ's key for it) only where lm_head is int4 too."""
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    return config | ({"lm_head": True} if lm_head else {})


def quantize_checkpoint(model: str, out: str | Path, method: str = "awq", group_size: int | None = None,
                        calibration_tokens: int = CALIBRATION_TOKENS, device: str = "auto", clip: bool = True,
                        lm_head: bool = False, tune_steps: int = TUNE_STEPS,
                        calibration_text: str | Path | None = None) -> Path:
    """Quantize a float checkpoint directory ("default": the embedded model) into `out`, which must
    not exist or be empty. Returns `out`. group_size is int4's (fp8-gptq has none); lm_head: int4
    only, lm_head quantized too; tune_steps: awq's end-to-end tuning's most steps (0: none);
    calibration_text: a UTF-8 text file for awq and fp8-gptq in place of the shipped one."""
    if method not in METHODS:
        raise ModelLoadError(f"method must be one of {', '.join(METHODS)}; got {method!r}.")
    if tune_steps < 0:
        raise ModelLoadError(f"tune_steps must be 0 (no tuning) or more; got {tune_steps}.")
    text = None if calibration_text is None else Path(calibration_text).expanduser()
    if text is not None:
        if method == "rtn":
            raise ModelLoadError("rtn reads no calibration text: leave --calibration-text out.")
        if not text.is_file():
            raise ModelLoadError(f"calibration text {text} is not a file.")
    src = resolve_model(model)
    cfg = ModelConfig.from_dir(src)
    if cfg.quantization is not None:
        raise ModelLoadError(f"{src} is already quantized ({cfg.quantization.method}); give a float checkpoint.")
    if method not in INT4_METHODS:
        if group_size is not None:
            raise ModelLoadError(f"{method} has one scale per output feature: leave --group-size out.")
        if lm_head:
            raise ModelLoadError(f"{method} leaves lm_head in bfloat16: --lm-head is for int4 (awq, rtn).")
    else:
        group_size = default_group_size(cfg, source_block_size(src)) if group_size is None else group_size
        cfg.check_awq_group_size(group_size, lm_head)
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelLoadError(f"{out} exists and is not an empty directory.")
    torch_device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    start = time.monotonic()
    decoder = load_model(src, torch.float32, torch_device)
    grids: dict[torch.nn.Module, Grid] = {}  # int4 GPTQ's grids (rtn: each group's own min/max)
    if method != "rtn":
        if not Tokenizer.present(src):
            raise ModelLoadError(f"{method} tokenizes its calibration text with the model's tokenizer; {src} has none.")
        try:
            sequences = calibration_sequences(Tokenizer.from_dir(src), calibration_tokens, text=text)
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"cannot read calibration text {text}: {exc}") from exc
        if not sequences:
            raise ModelLoadError(f"the calibration text must give at least 2 tokens (calibration_tokens: "
                                 f"{calibration_tokens}).")
        if method == "awq":
            targets = tuning_targets(decoder, sequences) if tune_steps > 0 else None  # the float model's
            awq_calibrate(decoder, sequences, group_size, clip)
            grids = int4_gptq_calibrate(decoder, sequences, group_size)
            if lm_head:  # before the tuning, which then tunes its scales too
                head_module, grids[head_module] = int4_lm_head_calibrate(decoder, sequences, group_size)
            if targets is not None:
                tune_end_to_end(decoder, targets, grids, group_size, tune_steps)
                del targets
        else:
            fp8_gptq_calibrate(decoder, sequences)
    head = None
    if lm_head:
        head = (decoder.lm_head.weight, grids[decoder.lm_head]) if method == "awq" else (lm_head_weight(decoder), None)
    hf_config = json.loads((src / "config.json").read_text())
    if method in INT4_METHODS:
        tensors = export_awq(decoder, group_size, grids, head)
        hf_config["quantization_config"] = awq_quantization_config(group_size, lm_head)
        hf_config["torch_dtype" if "torch_dtype" in hf_config else "dtype"] = "float16"
    else:
        tensors = export_fp8(decoder)
        hf_config["quantization_config"] = fp8_quantization_config()
        hf_config["torch_dtype" if "torch_dtype" in hf_config else "dtype"] = "bfloat16"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        for path in src.iterdir():  # tokenizer, chat template, generation config
            if path.is_file() and path.suffix != ".safetensors" and path.name not in _WEIGHT_FILES:
                shutil.copy2(path, tmp / path.name)
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("quantized %s (%s%s) into %s in %.1f s", src, method, f", group size {group_size}" if group_size else "",
             out, time.monotonic() - start)
    return out
