"""Weight-only quantization of a float checkpoint (`minillm quantize`): int4 in AutoAWQ's GEMM layout,
or FP8 in compressed-tensors' layout. Offline only: nothing on the serving path imports this package.

  rtn       each int4 group rounded to nearest on its own min/max grid (grid.py).
  awq       the calibration text (calibration.py) through the float model, layer by layer: AWQ's
            per-feature scales folded into the ops before and each group's range clipped (awq.py),
            then the weights rounded onto those grids by GPTQ instead of to nearest, each layer's
            Hessians from the quantized layers before it (gptq.py), last the group scales and RMSNorm
            weights tuned end to end against the float model's next-token distributions (tuning.py).
  fp8-gptq  FP8 (e4m3) weights with one scale per output feature, rounded by GPTQ (gptq.py).

With --lm-head (int4 only), lm_head is quantized as well, on the final hidden states (awq: clipping
searched, then GPTQ, before the end-to-end tuning, which tunes its scales with the others; rtn: to
nearest), written as `lm_head.qweight/.qzeros/.scales` with `lm_head: true` in quantization_config
(GPTQ's key; AutoAWQ keeps lm_head float). A tied embedding stays float.

The output directory (export.py) holds model.safetensors, config.json with its quantization_config,
and the tokenizer and generation files. docs/quantization.md has the measurements behind the choices.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.loader import load_model
from engine.model_store import resolve_model, source_block_size
from engine.models.config import ModelConfig
from engine.models.llama import DecoderModel
from engine.quantization.awq import awq_calibrate
from engine.quantization.calibration import CALIBRATION_TOKENS, calibration_sequences
from engine.quantization.export import (
    awq_quantization_config, export_awq, export_fp8, fp8_quantization_config, write_checkpoint,
)
from engine.quantization.gptq import fp8_gptq_calibrate, int4_gptq_calibrate, int4_lm_head_calibrate, lm_head_weight
from engine.quantization.grid import Grid, default_group_size
from engine.quantization.tuning import TUNE_STEPS, tune_end_to_end, tuning_targets
from engine.tokenizer import Tokenizer

__all__ = ["CALIBRATION_TOKENS", "INT4_METHODS", "METHODS", "TUNE_STEPS", "awq_quantization_config",
           "default_group_size", "export_awq", "lm_head_weight", "quantize_checkpoint"]

log = logging.getLogger("minillm.quantize")

METHODS = ("awq", "rtn", "fp8-gptq")
INT4_METHODS = ("awq", "rtn")


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
        grids = _calibrate(decoder, src, method, group_size, calibration_tokens, text, clip, lm_head, tune_steps)
    head = None
    if lm_head:
        head = (decoder.lm_head.weight, grids[decoder.lm_head]) if method == "awq" else (lm_head_weight(decoder), None)
    if method in INT4_METHODS:
        write_checkpoint(src, out, export_awq(decoder, group_size, grids, head),
                         awq_quantization_config(group_size, lm_head), "float16")
    else:
        write_checkpoint(src, out, export_fp8(decoder), fp8_quantization_config(), "bfloat16")
    log.info("quantized %s (%s%s) into %s in %.1f s", src, method, f", group size {group_size}" if group_size else "",
             out, time.monotonic() - start)
    return out


def _calibrate(decoder: DecoderModel, src: Path, method: str, group_size: int | None, calibration_tokens: int,
               text: Path | None, clip: bool, lm_head: bool, tune_steps: int) -> dict[torch.nn.Module, Grid]:
    """Run awq or fp8-gptq on the calibration text, changing the decoder's weights in place; returns
    awq's int4 grids per module (lm_head's too with lm_head), none for fp8-gptq."""
    if not Tokenizer.present(src):
        raise ModelLoadError(f"{method} tokenizes its calibration text with the model's tokenizer; {src} has none.")
    try:
        sequences = calibration_sequences(Tokenizer.from_dir(src), calibration_tokens, text=text)
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read calibration text {text}: {exc}") from exc
    if not sequences:
        raise ModelLoadError(f"the calibration text must give at least 2 tokens (calibration_tokens: "
                             f"{calibration_tokens}).")
    if method != "awq":
        fp8_gptq_calibrate(decoder, sequences)
        return {}
    targets = tuning_targets(decoder, sequences) if tune_steps > 0 else None  # the float model's
    awq_calibrate(decoder, sequences, group_size, clip)
    grids = int4_gptq_calibrate(decoder, sequences, group_size)
    if lm_head:  # before the tuning, which then tunes its scales too
        head_module, grids[head_module] = int4_lm_head_calibrate(decoder, sequences, group_size)
    if targets is not None:
        tune_end_to_end(decoder, targets, grids, group_size, tune_steps)
    return grids
