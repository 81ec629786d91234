"""awq's last step: the int4 model's group scales and RMSNorm weights tuned end to end, its levels and
zero points fixed, so that its next-token distributions on the calibration text match the float
model's (KL divergence). GPTQ and AWQ fit each layer's own output; this fits what the layers' errors
add up to, as norm tweaking and OmniQuant do."""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from engine.models.llama import DecoderModel
from engine.packed_prefill import pack_sequences
from engine.quantization.calibration import CALIBRATION_SEQ_LEN, _flush_denormals
from engine.quantization.grid import Grid
from kernels.dispatch import reference_kernels

log = logging.getLogger("minillm.quantize")

TUNE_STEPS = 40  # the end-to-end tuning's most Adam steps (awq)
TUNE_LR = 1e-3  # Adam's step on the scales' and norm weights' relative changes
TUNE_CHECK = 5  # steps between held-out checks
TUNE_PATIENCE = 2  # checks in a row without a new best that end the tuning
TUNE_HELD_OUT = 0.2  # the calibration text's last fifth: the held-out check's text


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
    (KL divergence, Adam on each value's relative change). Every TUNE_CHECK steps the held-out text's
    KL is measured; tuning stops after TUNE_PATIENCE checks in a row without a new best (more steps
    overfit a short calibration text), and the best values seen are kept. Updates the modules'
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
