"""GPTQ (Frantar et al., ICLR 2023): weights rounded one input feature at a time instead of to
nearest, each one's rounding error spread over the features not yet rounded, weighted by the inverse
Hessian of the layer's squared output error on the calibration text (H = 2 X^T X, dampened by
GPTQ_DAMP of its mean diagonal). Layer by layer, each layer's Hessians from the already quantized
layers' output.

  int4  onto the groups' grids that AWQ's scaling and clipping left (awq's last rounding step), and
        lm_head's on the final hidden states with --lm-head;
  fp8   FP8 (e4m3) with one scale per output feature (its largest magnitude maps to 448): fp8-gptq.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models.llama import DecoderLayer, DecoderModel
from engine.packed_prefill import pack_sequences
from engine.quantization.awq import _clip, _search_clip
from engine.quantization.calibration import _flush_denormals, _layer_by_layer
from engine.quantization.grid import Grid, _levels, _on_grid
from kernels.fp8_linear import FP8, FP8_MAX, quantize_fp8

GPTQ_DAMP = 0.1  # share of the Hessian's mean diagonal added to it (above GPTQ's 0.01: docs/quantization.md)
GPTQ_BLOCK = 128  # input features whose error updates are applied together


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
        cols, hb = w[:, start:end].clone(), hinv[start:end, start:end]
        errors = torch.empty(w.shape[0], end - start, device=w.device)
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
