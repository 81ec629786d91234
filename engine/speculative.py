"""Draft tokens for speculative decoding, and their verification against the target's own samples.

A decode step may carry k draft tokens per sequence: the target computes its last token and the k
drafts in one forward and samples every one of the k + 1 positions, each with the noise of its own
(seed, position), exactly as it would one step at a time. A draft is accepted while it equals the
token the target sampled at its position; the first sample that differs replaces it, and if every
draft is accepted the last sample comes as a bonus. So greedy and seeded outputs are the same
token for token with and without speculation, and a deterministic draft is accepted with the
target's probability of that token. A draft model (engine/draft_model.py) proposes from a
distribution; the emitted tokens are still the target's own samples, so the output distribution is
the target's whatever the draft proposes.
"""
from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence

METHODS = ("ngram", "suffix", "draft")
MAX_SKIP = 16  # the most decodes a sequence waits after rejected drafts before it drafts again
PATIENCE = 8  # misses in a row before a sequence starts skipping decodes
WARM_STEPS = 4  # decode steps without drafts that a batch size measures before it drafts
PROBE_STEPS = 8  # steps with drafts summed into each verdict on them
MIN_PAUSE, MAX_PAUSE = 16, 1024  # schedules without drafts after a verdict that they did not pay (doubling)
MIN_GAIN = 1.02  # how much faster drafting must go to keep on: a tie is not worth its waits
WHOLE_DECAY = 0.9  # the weight of a sequence's proposal in its record, against the one after it


def max_batch(device_type: str) -> int:
    """Running sequences up to which steps carry drafts. On a GPU verifying k + 1 tokens a sequence
    rides on the weights' reads until the batch is large: on the H200 a step with 4 drafts a
    sequence cost 1.4x a decode step at batch 1 and 8 on the 1B shape and 1.0-1.2x on the 8B, but
    2.7-5.4x at batch 64 (bench/README.md), hence 16. On a CPU every token costs compute: beside a
    batch of 8, sampled grounded QA still lost 6% (docs/performance.md) where batch 1 won."""
    return 16 if device_type == "cuda" else 1


@dataclass
class DraftState:
    """A sequence's recent luck with drafts. Each proposal rejected whole halves the next one's
    length, and any accepted draft restores it. From PATIENCE misses in a row (proposals rejected
    whole, or decodes with nothing to propose) the sequence skips its next 1, 2, 4, ... MAX_SKIP
    decodes: those run overlapped, so text that does not repeat itself costs little, while text
    that does keeps its drafts long."""

    length: int  # drafts to propose next
    skip: int = 0  # decodes to go before the next proposal
    misses: int = 0  # proposals in a row that the target rejected whole
    dry: int = 0  # decodes in a row with nothing to propose
    proposals: float = 0.0  # its proposals the target verified, each weighed WHOLE_DECAY less a newer one
    whole: float = 0.0  # of those, the ones it confirmed whole

    def record(self, drafted: int, confirmed: int, most: int) -> None:
        """After a proposal (drafted 0: none found) and the target's verdict."""
        if drafted == 0:
            self.dry += 1
            misses = self.dry
        else:
            self.dry = 0
            self.proposals = self.proposals * WHOLE_DECAY + 1
            self.whole = self.whole * WHOLE_DECAY + (confirmed == drafted)
            self.misses = misses = self.misses + 1 if confirmed == 0 else 0
            self.length = max(1, most >> self.misses)
        if misses >= PATIENCE:
            self.skip = min(2 ** (misses - PATIENCE), MAX_SKIP)

    @property
    def odds_whole(self) -> float:
        """The chance that its next proposal is confirmed whole: its recent record, from even odds
        (Laplace's rule of succession). The record weighs 10 proposals at most, so the odds stay
        below 11/12: nothing goes ahead where the host's work is under a twelfth of the device's
        step (Lookahead)."""
        return (self.whole + 1) / (self.proposals + 2)


@dataclass
class _Pace:
    """One batch size's decode speed, tokens a second per sequence (moving averages)."""

    plain: float = 0.0  # overlapped steps without drafts (a moving average)
    plain_steps: int = 0
    spec_tokens: float = 0.0  # a sequence's, in the steps with drafts since the last verdict
    spec_seconds: float = 0.0
    spec_steps: int = 0
    pause: int = 0  # schedules to go without drafts
    next_pause: int = MIN_PAUSE


class SpeedGate:
    """Whether drafting pays on this machine, by batch size (a power of two) from min_batch on: the
    engine's decode steps timed with drafts and without. Below min_batch (a sequence alone) it is
    always open: there each sequence's DraftState backs off by itself, and pauses judged on a
    single sequence's runs of acceptance cost more than they saved (bench/README.md). A step that
    drafts mostly waits for the step before it (drafts follow real ids; Lookahead lets some go
    ahead), so the host's work overlaps little and the verify step's extra rows nothing; on a fast
    GPU with a small model that costs more than the accepted drafts bring (bench/README.md).
    A batch size first measures WARM_STEPS steps without drafts; then after every PROBE_STEPS steps
    with drafts, unless their tokens over their time ran MIN_GAIN faster, drafting pauses for
    MIN_PAUSE schedules, doubling up to MAX_PAUSE while it keeps losing. A verdict sums its steps
    rather than averaging their rates: acceptance comes in runs, and a few steps of novel text alone
    would pause drafts through the copying that follows. Lookahead keeps one of its own, which
    times steps that go ahead (on trial, as drafting is here) against steps with drafts that wait."""

    def __init__(self, weight: float = 0.25, min_batch: int = 2) -> None:
        self.weight = weight  # of the newest step in the moving averages
        self.min_batch = min_batch
        self.paces: dict[int, _Pace] = {}

    def _pace(self, batch: int) -> _Pace:
        return self.paces.setdefault(1 << max(batch - 1, 0).bit_length(), _Pace())

    def open(self, batch: int) -> bool:
        """Whether steps of `batch` running sequences may draft (a look: no pause is counted down)."""
        if batch < self.min_batch:
            return True
        pace = self._pace(batch)
        return pace.plain_steps >= WARM_STEPS and not pace.pause

    def tick(self, batch: int) -> bool:
        """Once a schedule: open(batch), a schedule of its pause counted down."""
        if batch < self.min_batch:
            return True
        pace = self._pace(batch)
        if pace.pause:
            pace.pause -= 1
            return False
        return pace.plain_steps >= WARM_STEPS

    def record(self, trial: bool, batch: int, tokens: int, seconds: float) -> None:
        """A decode step of `batch` sequences read, with drafts (on trial) or without: `tokens`
        emitted, `seconds` since the step read before it."""
        if batch < self.min_batch:
            return
        pace = self._pace(batch)
        if not trial:
            rate = tokens / batch / max(seconds, 1e-9)
            pace.plain = rate if not pace.plain_steps else pace.plain + self.weight * (rate - pace.plain)
            pace.plain_steps += 1
            return
        pace.spec_tokens += tokens / batch
        pace.spec_seconds += seconds
        pace.spec_steps += 1
        if pace.spec_steps < PROBE_STEPS:
            return
        if pace.spec_tokens / max(pace.spec_seconds, 1e-9) < MIN_GAIN * pace.plain:
            pace.pause, pace.next_pause = pace.next_pause, min(2 * pace.next_pause, MAX_PAUSE)
        else:
            pace.next_pause = MIN_PAUSE
        pace.spec_tokens = pace.spec_seconds = pace.spec_steps = 0


class Lookahead:
    """When a step may go ahead of a step with drafts in flight (--speculative-overlap): launched
    before that step is read, as if its drafts were all confirmed. A sequence whose drafts were not
    is stale in it and loses that step, but never two in a row (the next restarts from its real
    tokens): with odds p that its proposals are confirmed whole (DraftState.odds_whole) it moves in
    1 / (2 - p) of the steps. Going ahead makes each step shorter by the host's work between reading
    a step and launching the next: max(`device`, `host`) long instead of `device` + `host`. So a
    step goes ahead while its sequences move on average (1 for those without drafts) in at least
    min_progress = max(device, host) / (device + host) of the steps, both measured on steps that
    waited (moving averages); until they are, none goes ahead.
    That account leaves out what guessing costs (a step launched ahead drafts past a guess of the
    last sample in flight), so a `gate` times the steps that went ahead against those that waited,
    by batch size, and pauses going ahead where it measures slower (as SpeedGate does drafting)."""

    def __init__(self, weight: float = 0.25) -> None:
        self.weight = weight  # of the newest step in the moving averages
        self.host = 0.0  # seconds from a step's ids landing on the host to the next launch
        self.device = 0.0  # seconds a step with drafts runs on the device
        self.min_progress = 1.0
        self.gate: SpeedGate | None = SpeedGate(weight, min_batch=1)  # None: ungated (tests)

    def record(self, host: float, device: float | None) -> None:
        """A step with drafts that waited for the one before: its host work on the critical path,
        and the device time of that one where it also waited (None: not measured)."""
        self.host = host if not self.host else self.host + self.weight * (host - self.host)
        if device is not None:
            self.device = device if not self.device else self.device + self.weight * (device - self.device)
        if self.device:  # a step launched ahead still waits for the host's work where that is longer
            self.min_progress = max(self.device, self.host) / (self.device + self.host)


class Proposer:
    """A draft source. Lookups propose a sequence at a time; a draft model computes every drafting
    sequence's proposals in one batch (prepare), which propose then hands out.

    A proposer that `guesses` may be asked for drafts while a sequence's last token is still being
    sampled (a placeholder) and the drafts of the step in flight stand in its tokens: it proposes
    one token more, its guess of that last one, and gives the tokens after the guess. The target
    verifies them as any drafts; a wrong guess only costs their acceptance."""

    num_tokens: int  # the most drafts it proposes for a sequence in one step
    guesses = False  # it can propose past a token still being sampled

    def prepare(self, seqs: list[Sequence], limits: list[int]) -> None:
        """Once a schedule, before any propose: the decodes that may draft, each with its most drafts."""

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow seq's tokens (all real ids), or none."""
        raise NotImplementedError

    def likely(self, seq: Sequence) -> bool:
        """Whether seq's real tokens so far have a proposal: then its next one, sampled in the step in
        flight, likely will too, and the engine waits for that step to draft after it. Text that
        does not repeat itself then decodes overlapped without waiting to find nothing."""
        return True

    def release(self, seq: Sequence) -> None:
        """seq finished or was aborted: drop what is kept for it."""


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a growing token list last ended, kept up to date a
    token at a time: a lookup costs a few dict reads, not a scan back over the text, which grew with
    the prompt on every step of every sequence."""

    def __init__(self, min_n: int, max_n: int, start: int = 0) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.start = start  # tokens before it are not indexed (a long prompt's head)
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> its latest end (exclusive)
        self.indexed = start  # n-grams ending at or before it are in `ends`

    def lookup(self, token_ids: Tokens[int], length: int, k: int, window: int, min_n: int | None = None,
               real: int | None = None) -> list[int]:
        """The k tokens (or fewer) after the latest earlier occurrence of the last n of token_ids'
        first `length` (the longest n first, down to min_n, by default the index's) that starts
        within `window` of its end. Only n-grams of the first `real` tokens (default: length) are
        indexed: the drafts of a step in flight may yet be rejected."""
        ends, start, max_n = self.ends, self.start, self.max_n
        # Every n-gram that ends before the last token (an occurrence must leave a token to follow),
        # by its end: later ends win. One slice a new end, its n-grams cut from it.
        stop = length if real is None else min(length, real + 1)
        for end in range(max(self.indexed + 1, start + self.min_n), stop):
            gram = tuple(token_ids[max(start, end - max_n):end])
            for n in range(self.min_n, len(gram) + 1):
                ends[gram[-n:]] = end
        self.indexed = max(self.indexed, stop - 1)
        tail = tuple(token_ids[max(0, length - max_n):length])
        for n in range(min(max_n, length - 1), max(self.min_n, min_n or 0) - 1, -1):
            end = ends.get(tail[-n:])
            if end is not None and end - n >= length - window:
                return list(token_ids[end:min(end + k, length)])
        return []


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last
    n tokens (n from max_n down to min_n), in its prompt and output (an NgramIndex a sequence).
    Each proposal of a sequence's that the target rejected whole asks one token more of the next
    match (up to max_n), until a draft is accepted: chat repeats short n-grams that predict
    nothing, and a proposal that is likely (`likely`) costs a step that waits for the one before."""

    guesses = True

    def __init__(self, num_tokens: int, max_n: int = 4, min_n: int = 2, window: int = 4096) -> None:
        self.num_tokens = num_tokens
        self.max_n = max_n
        self.min_n = min_n
        self.window = window  # the tokens searched, newest first: bounds the index's size
        self._indexes: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(num_tokens, limit) draft tokens to follow seq's tokens, or none."""
        k = min(self.num_tokens, limit)
        if k <= 0:
            return []
        if not seq.num_placeholders:
            return self._index(seq).lookup(seq.token_ids, len(seq.token_ids), k, self.window, self._min_n(seq))
        # The last token is in flight: a guess of it, then the drafts after the guess.
        return self._index(seq).lookup(seq.token_ids, len(seq.token_ids) - 1, k + 1, self.window, self._min_n(seq),
                                       seq.num_real_tokens)[1:]

    def likely(self, seq: Sequence) -> bool:
        return bool(self._index(seq).lookup(seq.token_ids, seq.num_real_tokens, 1, self.window, self._min_n(seq)))

    def _min_n(self, seq: Sequence) -> int:
        """The shortest match seq's next proposal may come from: longer after rejected proposals."""
        return min(self.min_n + (seq.drafting.misses if seq.drafting is not None else 0), self.max_n)

    def _index(self, seq: Sequence) -> NgramIndex:
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = NgramIndex(self.min_n, self.max_n, max(0, len(seq.token_ids) - self.window))
        return index

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq, None)


class SuffixAutomaton:
    """The suffix automaton of a token list, grown a token at a time (amortized O(1) each): every
    distinct substring is a path from state 0. Each state keeps its strings' first end position, so
    a match's continuation can be read from the tokens."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset  # where its first token is in the sequence it follows
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]  # transitions by token
        self.link: list[int] = [-1]  # suffix link: the longest suffix with other end positions
        self.length: list[int] = [0]  # the longest string of the state
        self.end: list[int] = [-1]  # the first position where the state's strings end
        self.last = 0  # the state of the whole list

    def extend(self, token: int) -> None:
        position = len(self.tokens)
        self.tokens.append(token)
        cur = self._state(self.length[self.last] + 1, position, {})
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:  # q also holds longer strings: split off the ones as long as p's plus one
                clone = self._state(self.length[p] + 1, self.end[q], dict(self.next[q]))
                self.link[clone] = self.link[q]
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def _state(self, length: int, end: int, transitions: dict[int, int]) -> int:
        self.next.append(transitions)
        self.link.append(-1)
        self.length.append(length)
        self.end.append(end)
        return len(self.length) - 1

    def repeat(self, k: int, min_match: int) -> list[int]:
        """Up to k tokens that followed the first earlier occurrence of the list's longest suffix
        that occurred before (at least min_match tokens long), or none."""
        state = self.link[self.last]  # the longest suffix that also ends somewhere earlier
        if state <= 0 or self.length[state] < min_match:
            return []
        return self.tokens[self.end[state] + 1: self.end[state] + 1 + k]

    def follow(self, tail: Tokens[int], k: int, min_match: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of `tail` found in this list (at least
        min_match tokens long), or none. A suffix found means its own suffixes are found too, so the
        longest is searched by length from min_match, doubling then halving: most tails miss at
        min_match tokens, which costs that many lookups rather than a pass over the whole tail."""
        size = len(tail)
        found, state = min_match, self._walk(tail, size - min_match) if size >= min_match else -1
        if state < 0:
            return []
        missed = size + 1  # the shortest length known not to be found
        while found < size and missed > found + 1:
            length = min(2 * found, size) if missed > size else (found + missed) // 2
            longer = self._walk(tail, size - length)
            if longer < 0:
                missed = length
            else:
                found, state = length, longer
        return self.tokens[self.end[state] + 1: self.end[state] + 1 + k]

    def _walk(self, tail: Tokens[int], start: int) -> int:
        """The state of tail[start:] (read from state 0), or -1 where it does not occur."""
        state = 0
        for i in range(start, len(tail)):
            state = self.next[state].get(tail[i], -1)
            if state < 0:
                return -1
        return state


class SuffixProposer(Proposer):
    """Suffix decoding: the tokens that followed the longest earlier occurrence of the sequence's
    own suffix in its prompt and output (a suffix automaton per sequence, grown as its tokens
    come), or else in the texts of recent sequences, of any request (agent loops and templated
    replies repeat across requests). Matches are as long as they go, not capped at n tokens."""

    guesses = True

    def __init__(self, num_tokens: int, min_match: int = 2, cross_min_match: int = 4, window: int = 4096,
                 recent: int = 8, tail: int = 32) -> None:
        self.num_tokens = num_tokens
        self.min_match = min_match  # within the sequence
        self.cross_min_match = cross_min_match  # in another sequence's text: longer, as it is less alike
        self.window = window  # a long prompt's last tokens only: bounds the automaton's build
        self.tail = tail  # the sequence's last tokens matched against other sequences
        self._automata: weakref.WeakKeyDictionary[Sequence, SuffixAutomaton] = weakref.WeakKeyDictionary()
        self._recent: deque[SuffixAutomaton] = deque(maxlen=recent)

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(num_tokens, limit) draft tokens to follow seq's tokens, or none."""
        k = min(self.num_tokens, limit)
        if k <= 0:
            return []
        if not seq.num_placeholders:
            return self._lookup(seq, k, len(seq.token_ids))
        # The last token is in flight: a guess of it, then the drafts after the guess.
        return self._lookup(seq, k + 1, len(seq.token_ids) - 1)[1:]

    def likely(self, seq: Sequence) -> bool:
        return bool(self._lookup(seq, 1, seq.num_real_tokens))

    def _lookup(self, seq: Sequence, k: int, length: int) -> list[int]:
        """propose's drafts after seq's first `length` tokens. The automaton takes real tokens only;
        the drafts of a step in flight past them are matched as a tail, within it."""
        real = min(length, seq.num_real_tokens)
        automaton = self._grown(seq, real)
        if real == length:
            drafts = automaton.repeat(k, self.min_match)
        else:
            tail = seq.token_ids[max(0, length - self.tail):length]
            drafts = automaton.follow(tail, k, self.min_match)
        if not drafts:
            tail = seq.token_ids[max(0, length - self.tail):length]
            drafts = next((d for other in reversed(self._recent) if other is not automaton
                           if (d := other.follow(tail, k, self.cross_min_match))), [])
        return drafts

    def forget(self) -> None:
        """Drop the memory of other sequences (a benchmark that repeats its requests calls it)."""
        self._recent.clear()

    def _grown(self, seq: Sequence, length: int) -> SuffixAutomaton:
        """seq's automaton over its first `length` tokens (real ids: never a placeholder)."""
        automaton = self._automata.get(seq)
        if automaton is None:
            automaton = self._automata[seq] = SuffixAutomaton(max(0, length - self.window))
            self._recent.append(automaton)
        for token in seq.token_ids[automaton.offset + len(automaton.tokens):length]:
            automaton.extend(token)
        return automaton


def accepted(drafts: Tokens[int], sampled: Tokens[int]) -> int:
    """How many drafts the target's samples confirm (sampled[i] is the target's token at the
    position drafts[i] took; len(sampled) == len(drafts) + 1)."""
    count = 0
    for draft, token in zip(drafts, sampled):
        if draft != token:
            break
        count += 1
    return count
