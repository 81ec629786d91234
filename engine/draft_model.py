"""Draft tokens from a second, small model with the target's tokenizer (--speculative-method draft).

The draft model runs in the engine's process, on the target's device and dtype, with its own
paged KV pool and block free list (no prefix caching). Once a schedule, `prepare` drafts for
every sequence that may draft, in one batch: a step feeds each sequence the tokens its draft KV
does not hold yet (the whole prompt the first time; after that, the confirmed drafts and the
target's last sample) and samples draft 1 at its last row, then k - 1 one-token steps each take
the previous step's sampled ids on the device (placeholders) and sample the next draft. The host
reads the ids once, at the end.

Verification: each draft is sampled with the target's sampling parameters and the noise of the
target's own (seed, position) (engine/sampler.py), and the target accepts a draft only while it
equals the target's own sample at that position (speculative.accepted). Every emitted token is
therefore a target sample, so the output distribution is exactly the target's (and greedy and
seeded outputs are those without speculation). This is not the rejection-sampling rule of
Leviathan et al., which accepts a draft with probability min(1, p/q): here the shared Gumbel noise
couples the two draws instead, so a draft is accepted whenever the noise's winner under the
draft's distribution is also the winner under the target's, which is likely where the two agree.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from engine.errors import ModelLoadError
from engine.model_runner import ModelRunner, StepInputs, cache_slots
from engine.models.llama import DecoderModel
from engine.sampler import SampleRow
from engine.sequence import Sequence, placeholder
from engine.speculative import Proposer


def check_vocab(draft_vocab: int, target_vocab: int, tokenizer_vocab: int | None) -> None:
    """Refuse a draft whose embedding does not hold the target's ids: the same vocabulary size, or
    (paddings differ between sizes of one family) every id of the target's tokenizer."""
    if draft_vocab == target_vocab or (tokenizer_vocab is not None and draft_vocab >= tokenizer_vocab):
        return
    held = f"the tokenizer's {tokenizer_vocab} ids" if tokenizer_vocab is not None else f"{target_vocab} ids"
    raise ModelLoadError(f"The speculative model's vocabulary ({draft_vocab} ids) does not match the model's "
                         f"({target_vocab}): it must hold {held}, with the same tokenizer.")


@dataclass
class _DraftKV:
    """What the draft KV pool holds for a sequence."""

    blocks: list[int] = field(default_factory=list)
    num_seen: int = 0  # the sequence's first tokens, whose KV is written
    drafts: list[int] = field(default_factory=list)  # drafts whose KV follows them, not yet confirmed
    fits: bool = True  # its prompt's ids are all in the draft's vocabulary


@dataclass
class _Proposal:
    seq: Sequence
    kv: _DraftKV
    count: int  # drafts to sample
    rows: list[int] = field(default_factory=list)  # its row in the sampled ids of all steps, per step
    row: int = 0  # its row in the last step's sampled ids: the next step's placeholder


class DraftModelProposer(Proposer):
    """Drafts sampled from a small model for every drafting sequence at once (see the module docstring)."""

    def __init__(self, model: DecoderModel, num_tokens: int, num_blocks: int, block_size: int, max_model_len: int,
                 sample_vocab_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 cuda_graphs: bool = True) -> None:
        self.num_tokens = num_tokens
        # On CUDA the one-token steps replay decode graphs (which draw plain rows themselves) and the
        # catch-up steps prefill graphs, where they fit: a small model's step is mostly launches.
        self.runner = ModelRunner(model, num_blocks, block_size, max_model_len, max_num_seqs,
                                  use_cuda_graphs=cuda_graphs, sample_vocab_size=sample_vocab_size,
                                  max_num_batched_tokens=max_num_batched_tokens)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = model.cfg.vocab_size
        self.max_num_batched_tokens = max_num_batched_tokens  # a catch-up step's tokens: long prompts go in chunks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks  # per block, the sequences whose tables hold it (forks share their prompt's)
        self._kv: dict[int, _DraftKV] = {}  # by seq_id
        self._prepared: dict[int, list[int]] = {}  # by seq_id, until propose hands them out

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """The drafts `prepare` sampled for seq, up to `limit`."""
        return self._prepared.pop(seq.seq_id, [])[:limit]

    def release(self, seq: Sequence) -> None:
        kv = self._kv.pop(seq.seq_id, None)
        for block in kv.blocks if kv is not None else ():
            self._refs[block] -= 1
            if not self._refs[block]:
                self.free_blocks.append(block)

    @torch.inference_mode()
    def prepare(self, seqs: list[Sequence], limits: list[int]) -> None:
        """Sample up to limits[i] drafts for each seqs[i]: one step over the tokens the draft has not
        seen, then a one-token step per further draft. A sequence whose blocks the pool cannot give,
        or whose prompt is still being fed in chunks, gets none."""
        self._prepared = {}
        proposals, logits = self._catch_up(seqs, limits)
        sampled: list[torch.Tensor] = []  # each step's sampled ids, on the device
        total = 0  # rows sampled in the steps before
        prev: torch.Tensor | None = None  # the last step's sampled ids: the next step's placeholders
        for step in range(max((p.count for p in proposals), default=0)):
            active = [p for p in proposals if p.count > step]
            rows = []
            for p in active:
                seq = p.seq
                # The target's (seed, position) noise: the two draws agree wherever their winners do.
                rows.append(SampleRow(seq.request.params, seq.seed, seq.num_tokens + step,
                                      seq.request.prompt_token_ids, ()))
            if step:
                logits = self.runner.forward(self._next_step(active, step, len(prev)), prev, rows)
            for i, p in enumerate(active):
                p.row = i
                p.rows.append(total + i)
            prev = self.runner.draw(logits, rows).token_ids
            # A decode graph draws into its runner's placeholder buffer, which the next replay overwrites.
            sampled.append(prev.clone() if self.runner.graphs else prev)
            total += len(active)
        if not sampled:
            return
        host = torch.cat(sampled).tolist()  # the one wait for the device
        for p in proposals:
            drafts = [host[row] for row in p.rows]
            p.kv.drafts = drafts[:-1]  # the last one's KV is not written
            self._prepared[p.seq.seq_id] = drafts

    def _catch_up(self, seqs: list[Sequence], limits: list[int]) -> tuple[list[_Proposal], torch.Tensor | None]:
        """Launch the step that feeds each sequence the tokens the draft has not seen; the sequences
        that sample draft 1 from it, and its logits (one row each)."""
        bs, budget = self.block_size, self.max_num_batched_tokens
        step = StepInputs([], [], [], [], [], [], [], [], None, False)
        proposals = []
        started: set[str] = set()  # requests a sequence's draft KV starts for in this step
        for seq in seqs:  # before this step feeds any: a fork shares only blocks already written
            if seq.seq_id not in self._kv and seq.request.request_id not in started:
                started.add(seq.request.request_id)
                self._kv[seq.seq_id] = self._fork(seq)
        for seq, limit in zip(seqs, limits):
            kv = self._kv.get(seq.seq_id)
            if kv is None:  # a fork whose sibling starts in this step: it shares that one's blocks next time
                continue
            tokens, n = seq.token_ids, seq.num_tokens
            for draft in kv.drafts:  # the drafts the target confirmed are seen; the others are overwritten
                if kv.num_seen == n or tokens[kv.num_seen] != draft:
                    break
                kv.num_seen += 1
            kv.drafts = []
            start = min(kv.num_seen, n - 1)  # the last token always goes in: its logits give draft 1
            end = min(n, start + budget)
            count = min(limit, self.num_tokens)
            if not kv.fits or end <= start or not self._reserve(kv, n + count - 1 if end == n else end):
                continue
            budget -= end - start
            step.input_ids += tokens[start:end]
            step.positions += range(start, end)
            step.slots += cache_slots(kv.blocks, start, end, bs)
            step.query_lens.append(end - start)
            step.seq_lens.append(end)
            step.block_tables.append(kv.blocks)
            kv.num_seen = end
            if end == n:
                step.logit_rows.append(len(step.input_ids) - 1)
                proposals.append(_Proposal(seq, kv, count))
        if not step.query_lens:
            return [], None
        return proposals, self.runner.forward(step, None)

    def _next_step(self, proposals: list[_Proposal], step: int, prev_rows: int) -> StepInputs:
        """A one-token step per proposal: its last draft (a placeholder for the previous step's
        sampled id, of prev_rows) at that draft's position; a decode graph's, where one is captured."""
        bs = self.block_size
        positions = [p.seq.num_tokens + step - 1 for p in proposals]
        inputs = StepInputs(
            input_ids=[placeholder(p.row) for p in proposals], positions=positions,
            slots=[p.kv.blocks[pos // bs] * bs + pos % bs for p, pos in zip(proposals, positions)],
            query_lens=[1] * len(proposals), seq_lens=[pos + 1 for pos in positions],
            block_tables=[p.kv.blocks for p in proposals], block_copies=[],
            logit_rows=list(range(len(proposals))), graph_batch=None, has_prev=True, decodes=True)
        inputs.graph_batch = self.runner.graph_for(inputs, prev_rows)
        return inputs

    def _fork(self, seq: Sequence) -> _DraftKV:
        """A sequence's first draft KV: the full blocks of its prompt that a sibling (another sample
        of its request) has written, shared, as the target's forks share their prompt's blocks.
        Neither writes them again: each writes only past what it has seen, which is past its prompt."""
        kv = _DraftKV(fits=max(seq.request.prompt_token_ids) < self.vocab_size)
        fed = max((self._kv[s.seq_id] for s in seq.request.sequences if s.seq_id in self._kv),
                  key=lambda sibling: sibling.num_seen, default=None)
        if fed is not None:
            shared = min(fed.num_seen, seq.num_prompt_tokens, seq.num_tokens - 1) // self.block_size
            kv.blocks, kv.num_seen = fed.blocks[:shared], shared * self.block_size
            for block in kv.blocks:
                self._refs[block] += 1
        return kv

    def _reserve(self, kv: _DraftKV, num_positions: int) -> bool:
        """Blocks for a sequence's first num_positions positions, if the pool has them."""
        need = -(-num_positions // self.block_size) - len(kv.blocks)
        if need > len(self.free_blocks):
            return False
        for _ in range(need):
            kv.blocks.append(self.free_blocks.popleft())
            self._refs[kv.blocks[-1]] = 1
        return True
