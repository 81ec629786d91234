"""Batched token sampling: grammar masks, logit bias, penalties, temperature, min-p/top-k/top-p, seeded Gumbel-max.

Logprobs are taken from the model's raw distribution, log_softmax of the unmodified logits (before
bias, penalties, temperature and filters), as vLLM does by default.

Randomness is counter-based: the Gumbel noise of a row at vocab index v is a pure function of
(seed, counter, v), computed by an integer hash on the logits' device, so a seeded row draws the
same token whatever else is in the batch and wherever it sits.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from engine.sampling_params import SamplingParams
from kernels.dispatch import to_device
from kernels.sampling import gumbel_argmax, int64_seeds
from kernels.token_mask import apply_token_mask as token_mask


@dataclass(slots=True)
class SampleRow:
    """One row of logits to sample from."""

    params: SamplingParams
    seed: int  # this sample's effective seed (the engine gives unseeded requests a random one)
    counter: int  # index of the token being sampled in its sequence; with seed, the key of its randomness
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass
class TokenLogprobs:
    """The sampled token's raw logprob and, if asked, the most likely alternatives."""

    token_id: int  # the sampled token
    logprob: float  # its logprob
    top: list[tuple[int, float]]  # params.logprobs most likely (token_id, logprob), most likely first


@dataclass(slots=True)
class HostIds:
    """Sampled ids that the kernel drawing them writes into a row of pinned host memory (the decode
    graphs' ring, engine/model_runner.py), so no copy follows it: valid until the ring comes round
    to the row again."""

    ids: torch.Tensor  # pinned int64 [B]: the row's first B entries
    uses: list[int]  # per ring row, how many steps have written it
    row: int
    use: int  # uses[row] when this step wrote it

    def tolist(self) -> list[int]:
        if self.uses[self.row] != self.use:
            raise RuntimeError("sampled ids read after their ring row was written again")
        return self.ids.tolist()


class SamplerOutput:
    """The batch's sampled tokens and logprobs, still on the device: the engine reads them (one copy
    to the host, started by `start_copy`, or none for ids a kernel wrote to the host: `host_ids`)
    only after it has launched the next step."""

    def __init__(self, token_ids: torch.Tensor, logprob_rows: list[int] | None = None,
                 num_top: list[int] | None = None, chosen: torch.Tensor | None = None,
                 top_values: torch.Tensor | None = None, top_ids: torch.Tensor | None = None,
                 host_ids: HostIds | None = None) -> None:
        self.token_ids = token_ids  # [B] int64, on the logits' device
        self._rows = logprob_rows or []  # rows that asked for logprobs
        self._num_top = num_top or []  # per such row, how many alternatives it asked for
        self._tensors = [t for t in (token_ids, chosen, top_values, top_ids) if t is not None]
        self._host_ids = host_ids
        self._event: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        """Begin the device-to-host copy without waiting for it (pinned buffers, then an event)."""
        if self.token_ids.device.type != "cuda":
            return
        first, rest = self._tensors[0], self._tensors[1:]
        self._tensors = [self._host_ids if self._host_ids is not None else first.to("cpu", non_blocking=True),
                         *(t.to("cpu", non_blocking=True) for t in rest)]
        self._event = torch.cuda.Event()
        self._event.record()

    @cached_property
    def _host(self) -> list[list]:
        if self._event is not None:
            self._event.synchronize()
        return [t.tolist() for t in self._tensors]

    @property
    def token_id_list(self) -> list[int]:
        return self._host[0]

    @cached_property
    def logprobs(self) -> list[TokenLogprobs | None]:
        """Per row: the sampled token's raw logprob and its top alternatives; None where not asked."""
        result: list[TokenLogprobs | None] = [None] * len(self._host[0])
        if not self._rows:
            return result
        token_ids, chosen, top_values, top_ids = self._host
        for j, (i, n) in enumerate(zip(self._rows, self._num_top)):
            result[i] = TokenLogprobs(token_ids[i], chosen[j], list(zip(top_ids[j][:n], top_values[j][:n])))
        return result


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The logits as float32 scores, -inf where a row may not go (a copy). `mask` is the batch's
    [B, ceil(V / 32)] int32 bitmask in xgrammar's layout, filled on the host
    (engine/grammar_worker.py): bit v of row r set means row r may take token v; rows without a
    grammar have every bit set. One copy to the device and one kernel (kernels/token_mask.py)."""
    if mask is None:
        return logits.float()
    return token_mask(logits, mask.to(logits.device, non_blocking=True))


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """A [B, 1] float32 tensor of one per-row parameter, to broadcast over the vocabulary."""
    return to_device(list(values), torch.float32, device).reshape(len(values), 1)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Add each row's logit_bias to its logits (out of place)."""
    row_idx: list[int] = []
    token_idx: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            row_idx.append(i)
            token_idx.append(int(token_id))
            biases.append(float(bias))
    if not biases:
        return logits
    device = logits.device
    index = (to_device(row_idx, torch.int64, device), to_device(token_idx, torch.int64, device))
    return logits.index_put(index, to_device(biases, logits.dtype, device), accumulate=True)


def _token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32 count of each token id per row, by scatter_add from a padded id tensor."""
    width = max((len(ids) for ids in token_ids), default=0)
    # Padding points at an extra column that is dropped afterwards.
    padded = [list(ids) + [vocab_size] * (width - len(ids)) for ids in token_ids]
    index = to_device(padded, torch.int64, device).reshape(len(token_ids), width)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Apply the repetition penalty, then frequency and presence penalties (out of place).

    repetition (HF/vLLM), for tokens in the prompt or output: logit / p if logit > 0 else logit * p.
    frequency/presence (OpenAI), over output tokens: logit -= count * frequency + (count > 0) * presence.
    """
    params = [row.params for row in rows]
    needs_repetition = any(p.repetition_penalty != 1.0 for p in params)
    needs_counts = any(p.frequency_penalty or p.presence_penalty for p in params)
    if not (needs_repetition or needs_counts):
        return logits
    vocab_size, device = logits.shape[-1], logits.device
    output_counts = _token_counts([row.output_token_ids for row in rows], vocab_size, device)
    if needs_repetition:
        penalty = _column([p.repetition_penalty for p in params], device)
        prompt_counts = _token_counts([row.prompt_token_ids for row in rows], vocab_size, device)
        seen = (prompt_counts > 0) | (output_counts > 0)
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    if needs_counts:
        frequency = _column([p.frequency_penalty for p in params], device)
        presence = _column([p.presence_penalty for p in params], device)
        logits = logits - output_counts * frequency - (output_counts > 0).float() * presence
    return logits


def apply_filters(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Mask to -inf the tokens outside each row's min_p, then top_k, then top_p set (vLLM's order).

    `logits` are already divided by temperature. top_p applies to the distribution top_k leaves,
    renormalized; the most likely token is always kept.
    """
    params = [row.params for row in rows]
    vocab_size, device = logits.shape[-1], logits.device
    if any(p.min_p > 0 for p in params):
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); min_p = 0 gives -inf, masks nothing.
        floor = logits.amax(dim=-1, keepdim=True) + _column([p.min_p for p in params], device).log()
        logits = logits.masked_fill(logits < floor, float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    if all(k == vocab_size for k in top_k) and all(p.top_p >= 1.0 for p in params):
        return logits
    ordered, order = logits.sort(dim=-1, descending=True)  # one sort serves top_k and top_p
    ranks = torch.arange(vocab_size, device=device)
    ordered = ordered.masked_fill(ranks >= _column(top_k, device), float("-inf"))
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    # top_p = 1 must keep everything, even where rounding pushes the cumulative sum past 1.
    top_p = _column([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device)
    ordered = ordered.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ordered)


def _filters(params: SamplingParams, vocab_size: int) -> bool:
    """Whether a sampled row keeps only part of the vocabulary (min_p, top_k or top_p)."""
    return params.min_p > 0 or 0 < params.top_k < vocab_size or params.top_p < 1.0


def _filtered(scores: torch.Tensor, rows: Sequence[SampleRow], temperatures: list[float]) -> torch.Tensor:
    """Scores with the filtering rows divided by their temperature and filtered (apply_filters); their
    temperatures become 1, so the draw adds the noise to them unscaled. Others as they are."""
    index = [i for i, row in enumerate(rows) if temperatures[i] > 0 and _filters(row.params, scores.shape[-1])]
    if not index:
        return scores
    at = to_device(index, torch.int64, scores.device)
    scaled = scores[at] / _column([temperatures[i] for i in index], scores.device)
    scores = scores.clone()  # the raw logits stay for the logprobs
    scores[at] = apply_filters(scaled, [rows[i] for i in index])
    for i in index:
        temperatures[i] = 1.0
    return scores


def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SampleRow],
              host_ids: HostIds | None = None) -> SamplerOutput:
    """The sampled tokens with, for rows that ask, their raw-distribution logprob and top tokens."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return SamplerOutput(token_ids, host_ids=host_ids)
    index = to_device(wanted, torch.int64, raw.device)
    logprobs = raw[index].float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[index][:, None])[:, 0]
    num_top = [rows[i].params.logprobs or 0 for i in wanted]
    top_values, top_ids = logprobs.topk(max(num_top), dim=-1)  # k = 0 gives empty rows
    return SamplerOutput(token_ids, wanted, num_top, chosen, top_values, top_ids, host_ids)


class Sampler:
    """Picks one token per row of a [B, V] logits batch; stateless, so one instance serves the engine.

    vocab_size, if less than V, is the tokenizer's: a model's vocabulary may be padded past it, and
    ids it cannot decode are never sampled (nor listed in logprobs).
    """

    def __init__(self, vocab_size: int | None = None) -> None:
        self.vocab_size = vocab_size

    def prompt_logprobs(self, logits: torch.Tensor, targets: list[int], num_top: list[int]) -> SamplerOutput:
        """Row i's logprob of targets[i] (the prompt token its position predicts) and its num_top[i]
        most likely tokens, from the raw distribution; the output's token ids are the targets."""
        logprobs = logits[:, : self.vocab_size].float().log_softmax(dim=-1)
        token_ids = to_device(targets, torch.int64, logits.device)
        chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
        top_values, top_ids = logprobs.topk(max(num_top), dim=-1)
        return SamplerOutput(token_ids, list(range(len(targets))), num_top, chosen, top_values, top_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], mask: torch.Tensor | None = None) -> SamplerOutput:
        """Sample a token per row: greedy rows take the argmax, the others Gumbel-max under their seed;
        rows that `mask` names only among their allowed tokens."""
        raw = logits[:, : self.vocab_size]
        scores = apply_penalties(apply_logit_bias(apply_token_mask(raw, mask), rows), rows)
        temperatures = [row.params.temperature for row in rows]
        scores = _filtered(scores, rows, temperatures)
        token_ids = gumbel_argmax(scores, temperatures, [row.seed for row in rows], [row.counter for row in rows])
        return _logprobs(raw, token_ids, rows)

    def draws(self, rows: Sequence[SampleRow], vocab_size: int) -> tuple[list[float], list[int], list[int]] | None:
        """Where every row is a plain draw (greedy, or a temperature alone: no bias, penalties or
        filters), each row's temperature, seed (kernels/sampling.py's int64_seeds) and counter, with
        which gumbel_argmax_triton picks what this sampler would (a decode graph draws by itself);
        else None. vocab_size: the logits' width before the tokenizer's cut."""
        vocab = min(vocab_size, self.vocab_size or vocab_size)
        for row in rows:
            params = row.params
            if params.logit_bias or params.penalized or (params.temperature > 0 and _filters(params, vocab)):
                return None
        return ([row.params.temperature for row in rows], int64_seeds([row.seed for row in rows]),
                [row.counter for row in rows])

    def drawn(self, logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SampleRow],
              host_ids: HostIds | None = None) -> SamplerOutput:
        """The output for rows whose tokens were drawn elsewhere (draws): their logprobs, if asked;
        host_ids, if the drawing kernel also wrote them to the host."""
        return _logprobs(logits[:, : self.vocab_size], token_ids, rows, host_ids)
