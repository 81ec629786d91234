"""Continuous batching: which sequences compute how many tokens in the next step.

Each step packs running decodes and prefill chunks under a token budget, then admits waiting
sequences. When blocks run out, the newest running sequence is preempted by recompute: its blocks
are freed and it goes back to the front of the queue with its tokens, so its output is unchanged.

Fairness: one prompt at a time may prefill in chunks (take more than a step). While it does, a
waiting prompt that fits in the step passes longer ones, and the chunk leaves it half the budget;
so a huge prompt, or a call of many, never holds a short request behind it for more than a step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from engine.speculative import DraftState, Lookahead, Proposer, SpeedGate


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step (0 for a fork that samples from its parent)
    sample_from: Sequence | None = None  # forks sample from their parent's logits in the step they are made
    samples: bool = False  # this step reaches the end of seq's tokens, so a token is sampled
    drafts: list[int] = field(default_factory=list)  # draft tokens computed after seq's last, each sampled too
    # Launched on drafts of the step before it that the target then rejected: its rows are not read.
    stale: bool = False


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
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 proposer: Proposer | None = None, max_draft_batch: int = 16, gate: SpeedGate | None = None,
                 lookahead: Lookahead | None = None) -> None:
        self.block_manager = block_manager
        self.proposer = proposer  # decodes carry its draft tokens when it has some
        self.max_draft_batch = max_draft_batch  # running sequences up to which steps draft (speculative.max_batch)
        self.gate = gate  # whether drafting pays at the batch size, as measured; None: it always may
        # With --speculative-overlap and a proposer that guesses: decodes may draft past a token still
        # being sampled, and steps go ahead of steps with drafts in flight (LLMEngine.step).
        self.lookahead = lookahead if proposer is not None and proposer.guesses else None
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
        chunking = False  # a prefill that needs more than this step is under way: only one at a time
        running = list(self.running)
        decodes_left = 0
        for seq in running:  # the loops over the batch read len(token_ids), not the property (bench/host_step.py)
            decodes_left += len(seq.token_ids) - seq.num_computed_tokens == 1
        limits = self._draft_limits(running)
        for seq in running:
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            drafts: list[int] = []
            if remaining == 1:
                decodes_left -= 1
                num_new = min(1, budget)
                if num_new and seq in limits:
                    drafts = self._drafts(seq, min(limits[seq], budget - decodes_left - 1))
                    num_new += len(drafts)
            else:  # a prefill chunk leaves room for the decodes behind it
                num_new = self._chunk(remaining, budget - decodes_left)
                chunking = chunking or num_new < remaining
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
                self._schedule(out, seq, num_new, drafts)
        # Admit waiting sequences in arrival order, unless memory was just short. While a prompt is
        # chunked, longer ones than the step holds wait (passed) and shorter ones behind them go.
        # Counted only when something waits: a steady decode step skips the loop over the batch.
        slots = (len(self.running) + sum(s.request.num_pending_forks for s in self.running if s.index == 0)
                 if self.waiting else 0)
        passed: list[Sequence] = []
        while not preempted and self.waiting and budget > 0:
            seq = self.waiting.popleft()
            if chunking and seq.num_tokens > budget:
                passed.append(seq)
                continue
            need = 1 + (seq.request.num_pending_forks if seq.index == 0 else 0)  # its forks run beside it
            if slots + need > self.max_num_seqs:
                self.waiting.appendleft(seq)
                break
            hits = self.block_manager.match_prefix(seq)
            num_cached = len(hits) * self.block_manager.block_size
            num_new = self._chunk(seq.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(seq, num_new, hits):
                self.waiting.appendleft(seq)
                break
            if seq.num_computed_tokens == 0 and seq.num_tokens == seq.num_prompt_tokens:
                seq.num_cached_prompt_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            slots += need
            budget -= num_new
            chunking = chunking or num_cached + num_new < seq.num_tokens
            self._schedule(out, seq, num_new)
        self.waiting.extendleft(reversed(passed))
        out.block_copies = self.block_manager.take_copies()
        return out

    def _chunk(self, remaining: int, budget: int) -> int:
        """A prefill's tokens this step: all it has left if they fit the budget, else a chunk, which
        leaves half the budget when a waiting prompt fits in that half."""
        if remaining <= budget or budget < 2:
            return min(remaining, budget)
        half = budget // 2
        return budget - half if any(s.num_tokens <= half for s in self.waiting) else budget

    def drafting(self) -> bool:
        """Whether the next schedule may give a decode drafts that must follow real ids: then the
        engine reads the step in flight first. Not past max_draft_batch running sequences, nor
        while every one waits out its misses (speculative.DraftState) or has nothing it would likely
        propose (Proposer.likely), nor while the gate is shut; nor for a decode that may draft
        past the step in flight (guesses)."""
        return (self.proposer is not None and len(self.running) <= self.max_draft_batch
                and (self.gate is None or self.gate.open(len(self.running)))
                and any((s.drafting is None or not s.drafting.skip) and not self.guesses(s) and self.proposer.likely(s)
                        for s in self.running))

    def guesses(self, seq: Sequence) -> bool:
        """Whether seq may draft past its tokens in flight (with a lookahead): not where penalties
        read its history or a grammar masks its rows, as both need its real tokens."""
        params = seq.request.params
        return self.lookahead is not None and not params.penalized and params.structured is None

    def goes_ahead(self, in_flight: list[ScheduledSequence]) -> bool:
        """Whether the next step may be launched before the step in flight, which carries drafts, is
        read. A step with drafts moves each sequence by as many tokens as the target accepts; the
        next one assumes all of them, and where fewer are, that sequence's rows in it are stale. So
        only if every sequence with drafts guesses, and they are confirmed whole often enough for
        the time it saves (Lookahead), and going ahead is not paused at this batch size."""
        lookahead = self.lookahead
        if lookahead is None or (lookahead.gate is not None and not lookahead.gate.tick(len(in_flight))):
            return False
        progress = 0.0
        for s in in_flight:
            if not s.drafts or s.stale or s.seq.is_finished:  # the next step does not hang on these
                progress += 1.0
            elif not self.guesses(s.seq):
                return False
            else:
                progress += 1.0 / (2.0 - s.seq.drafting.odds_whole)
        return progress >= len(in_flight) * lookahead.min_progress

    def _draft_limits(self, running: list[Sequence]) -> dict[Sequence, int]:
        """The decodes that may draft this step, each with its most drafts (before the step's token
        budget cuts them); the proposer prepares their drafts in one go. Each sequence's DraftState
        counts down its skip here, once a schedule."""
        if (self.proposer is None or len(self.running) > self.max_draft_batch
                or (self.gate is not None and not self.gate.tick(len(self.running)))):
            return {}
        limits = {}
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens == 1 and (limit := self._draft_limit(seq)) > 0:
                limits[seq] = limit
        if limits:
            self.proposer.prepare(list(limits), list(limits.values()))
        return limits

    def _draft_limit(self, seq: Sequence) -> int:
        """The most drafts a decoding seq may take: its DraftState's length, never past its
        max_tokens. Zero while its last token is still being sampled (the draft follows real ids),
        or for a prompt's last token (its forks take its blocks this step)."""
        if seq.num_tokens == seq.num_prompt_tokens:
            return 0
        state = seq.drafting = seq.drafting or DraftState(self.proposer.num_tokens)
        if state.skip:
            state.skip -= 1
            return 0
        if seq.num_placeholders and not self.guesses(seq):
            return 0
        generated = seq.num_tokens - seq.num_prompt_tokens
        return min(state.length, seq.request.max_tokens - generated - 1)

    def _drafts(self, seq: Sequence, limit: int) -> list[int]:
        """The proposer's draft tokens for a decoding seq, up to `limit`; none found is a miss."""
        if limit <= 0:
            return []
        drafts = self.proposer.propose(seq, limit)
        if not drafts:
            seq.drafting.record(0, 0, self.proposer.num_tokens)  # a miss: its text does not repeat here
        return drafts

    @property
    def num_waiting(self) -> int:
        """Sequences not running yet: those queued, and the samples a queued request will fork."""
        return len(self.waiting) + sum(s.request.num_pending_forks for s in self.waiting if s.index == 0)

    def _schedule(self, out: SchedulerOutput, seq: Sequence, num_new: int, drafts: list[int] | None = None) -> None:
        drafts = drafts or []
        samples = seq.num_computed_tokens + num_new - len(drafts) == len(seq.token_ids)
        out.scheduled.append(ScheduledSequence(seq, num_new, samples=samples, drafts=drafts))
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
        """After the forward: the scheduled tokens' KV is in the cache. A step with drafts counts
        them all, and when its samples are read, LLMEngine._accept takes back the rejected ones; only
        blocks full of real tokens are hashed."""
        block_size = self.block_manager.block_size
        for s in out.scheduled:
            seq = s.seq
            if s.num_new_tokens and not s.stale and seq.status != SequenceStatus.FINISHED:
                old = seq.num_computed_tokens
                new = seq.num_computed_tokens = old + s.num_new_tokens
                prompt = len(seq.request.prompt_token_ids)
                if old < prompt:
                    self.num_computed_prompt_tokens += min(new, prompt) - old
                if new // block_size != old // block_size:  # a block filled: a decode fills one in block_size
                    self.block_manager.cache_full_blocks(seq, old)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop seq (done or aborted) and return its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if self.proposer is not None:
            self.proposer.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        # Tokens still being sampled for it are surplus: a finished sequence holds real ids only.
        del seq.token_ids[seq.num_real_tokens :]
        seq.num_placeholders = 0
