"""Continuous batching: which sequences compute how many tokens in the next step.

Each step packs running decodes and prefill chunks under a token budget, then admits waiting
sequences. When blocks run out, the newest running sequence is preempted by recompute: its blocks
are freed and it goes back to the front of the queue with its tokens, so its output is unchanged.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step (0 for a fork that samples from its parent)
    sample_from: Sequence | None = None  # forks sample from their parent's logits in the step they are made
    samples: bool = False  # this step reaches the end of seq's tokens, so a token is sampled


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def derive_seed(seed: int, index: int) -> int:
    """Sample i of a seeded request gets its own stream; sample 0 keeps the request's seed."""
    return seed if index == 0 else (seed * 1_000_003 + index * 7_919) % (1 << 62)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0  # prompt KV computed (not served from the prefix cache)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        running = list(self.running)
        decodes_left = sum(1 for s in running if s.num_tokens - s.num_computed_tokens == 1)
        for seq in running:
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining == 1:
                decodes_left -= 1
                num_new = min(1, budget)
            else:  # a prefill chunk leaves room for the decodes behind it
                num_new = min(remaining, budget - decodes_left)
            if num_new <= 0:
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                budget -= num_new
                self._schedule(out, seq, num_new)
        # Admit waiting sequences, unless memory was just short.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.block_manager.match_prefix(seq)
            num_cached = len(hits) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(seq, num_new, hits):
                break
            self.waiting.popleft()
            if seq.num_computed_tokens == 0 and seq.num_tokens == seq.num_prompt_tokens:
                seq.num_cached_prompt_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= num_new
            self._schedule(out, seq, num_new)
        out.block_copies = self.block_manager.take_copies()
        return out

    def _schedule(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        samples = seq.num_computed_tokens + num_new == seq.num_tokens
        out.scheduled.append(ScheduledSequence(seq, num_new, samples=samples))
        request = seq.request
        if samples and seq.index == 0 and request.num_pending_forks:
            # The prompt is complete this step: the other samples share its blocks from now on.
            for index in range(len(request.sequences), request.params.n):
                child = Sequence(request, index, list(seq.token_ids), derive_seed(seq.seed, index))
                self.block_manager.fork(seq, child)
                child.num_computed_tokens = seq.num_tokens
                child.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
                child.status = SequenceStatus.RUNNING
                request.sequences.append(child)
                self.running.append(child)
                out.scheduled.append(ScheduledSequence(child, 0, sample_from=seq, samples=True))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update_computed(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens' KV is in the cache."""
        for s in out.scheduled:
            if s.num_new_tokens and not s.seq.is_finished:
                old = s.seq.num_computed_tokens
                s.seq.num_computed_tokens += s.num_new_tokens
                self.num_computed_prompt_tokens += max(0, min(s.seq.num_computed_tokens, s.seq.num_prompt_tokens) - old)
                self.block_manager.cache_full_blocks(s.seq, old)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop seq (done or aborted) and return its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        # Tokens still being sampled for it are surplus: a finished sequence holds real ids only.
        del seq.token_ids[seq.num_real_tokens :]
        seq.num_placeholders = 0
