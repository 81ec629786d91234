"""The calibration text, and the layer-by-layer pass that AWQ and GPTQ run it through: each decoder
layer's linear inputs captured on the calibration batch, the layer changed, the next layer fed."""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine.models.llama import DecoderLayer, DecoderModel
from engine.packed_prefill import pack_sequences
from engine.tokenizer import Tokenizer
from kernels.dispatch import reference_kernels
from kernels.rmsnorm import rms_norm

log = logging.getLogger("minillm.quantize")

# The Declaration of Independence, then the Articles of Confederation: legal prose, the kind of text the
# perplexity benchmark scores (docs/quantization.md says what that means for the figures).
CALIBRATION_TEXT = Path(__file__).parents[1] / "data" / "calibration.txt"
CALIBRATION_TOKENS = 8192  # the default: all of it (5,946 tokens for SmolLM2)
CALIBRATION_SEQ_LEN = 512


def calibration_sequences(tokenizer: Tokenizer, max_tokens: int, seq_len: int = CALIBRATION_SEQ_LEN,
                          text: Path | None = None) -> list[list[int]]:
    """The first `max_tokens` tokens of a calibration text (default: the shipped one), in sequences
    of up to seq_len."""
    tokens = tokenizer.encode((text or CALIBRATION_TEXT).read_text(encoding="utf-8"))[:max_tokens]
    sequences = [tokens[i:i + seq_len] for i in range(0, len(tokens), seq_len)]
    return [s for s in sequences if len(s) > 1]


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
    # The torch references: no projection takes its norm or RoPE into its kernel, so the hooks below
    # see every projection's input (the fused kernels would, up to a few rows on Triton).
    with _flush_denormals(), reference_kernels():
        eps = model.cfg.rms_norm_eps
        hidden, residual = rms_norm(model.embed_tokens(batch.input_ids), model.layers[0].input_layernorm, eps)
        for i, layer in enumerate(model.layers):
            # The next layer's normalized input (the last layer's output normalized by the final norm, unused).
            next_norm = model.layers[i + 1].input_layernorm if i + 1 < len(model.layers) else model.norm
            start = time.monotonic()
            inputs: dict[str, torch.Tensor] = {}
            hooks = [getattr(layer, name).register_forward_pre_hook(
                         lambda _m, args, name=name: inputs.__setitem__(name, args[0].float()))
                     for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
            try:
                out = layer(batch.positions, hidden, None, residual, batch.kv_cache[0], batch.meta, model.cos_sin,
                            next_norm)
            finally:
                for hook in hooks:
                    hook.remove()
            change(layer, inputs, functools.partial(layer.self_attention, batch.positions, kv_cache=batch.kv_cache[0],
                                                    meta=batch.meta, cos_sin=model.cos_sin))
            if feed_changed:
                out = layer(batch.positions, hidden, None, residual, batch.kv_cache[0], batch.meta, model.cos_sin,
                            next_norm)
            hidden, residual, _ = out  # reference kernels: no norm folds
            log.info("%s layer %d/%d: %.1f s", what, i + 1, model.cfg.num_layers, time.monotonic() - start)
