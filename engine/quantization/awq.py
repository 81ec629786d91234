"""Activation-aware weight quantization (Lin et al., "AWQ", MLSys 2024), as AutoAWQ does it, on the
calibration text's activations, layer by layer.

For each linear layer's input take the mean |activation| per input feature and grid-search alpha in
[0, 1) for per-feature scales s = mean|x|^alpha / mean|w|^(1 - alpha) (normalized; no scaling is a
candidate too) minimizing the squared error of the block's output computed with Q(W * s) on x / s:
the attention block's for QKV, the MLP's for gate/up, their own for o_proj and down_proj. 1/s is
folded into the op before (input_layernorm for QKV, post_attention_layernorm for gate/up, up_proj's
rows for down_proj, v_proj's rows for o_proj unless grouped-query attention shares v rows between
heads, where AutoAWQ skips it too), so the float model computes the same. Then each group's range is
clipped (not for q/k) where that lowers the error of the group's partial dot products on the
calibration activations. Each layer is searched on the activations the original float model feeds it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from engine.models.config import ModelConfig
from engine.models.llama import DecoderLayer, DecoderModel
from engine.quantization.calibration import _layer_by_layer
from engine.quantization.grid import _fake_quantize_weight, fake_quantize

GRID = 20  # alphas 0, 1/20, ..., 19/20 (AutoAWQ's grid)
CLIP_STEPS = 10  # each end of a group's range shrunk by 0, 5, ..., 45%


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
    # (40 tries instead of all 100 pairs, and as good on SmolLM2).
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


@contextlib.contextmanager
def _weight(module: torch.nn.Module, weight: torch.Tensor) -> Iterator[None]:
    """The module computing with another weight, for a while."""
    saved = module.weight.data
    module.weight.data = weight
    try:
        yield
    finally:
        module.weight.data = saved


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


def awq_calibrate(model: DecoderModel, sequences: list[list[int]], group_size: int, clip: bool = True) -> None:
    """Fold AWQ's scales into a float model in place, and clip its weights, layer by layer. The next
    layer sees the float layer's output, as in AutoAWQ."""
    _layer_by_layer(model, sequences, "AWQ", False, lambda layer, inputs, attention: _awq_layer(
        layer, model.cfg, inputs, group_size, clip, attention))
