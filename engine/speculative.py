"""Draft tokens for speculative decoding, and their verification against the target's own samples.

A decode step may carry k draft tokens per sequence: the target computes its last token and the k
drafts in one forward and samples every one of the k + 1 positions, each with the noise of its own
(seed, position), exactly as it would one step at a time. A draft is accepted while it equals the
token the target sampled at its position; the first sample that differs replaces it, and if every
draft is accepted the last sample comes as a bonus. So greedy and seeded outputs are the same
token for token with and without speculation, and a deterministic draft is accepted with the
target's probability of that token.
"""
from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.sequence import Sequence

METHODS = ("ngram",)
MAX_SKIP = 16  # the most decodes a sequence waits after rejected drafts before it drafts again
PATIENCE = 8  # misses in a row before a sequence starts skipping decodes


def max_batch(device_type: str) -> int:
    """Running sequences up to which steps carry drafts. On a GPU verifying k + 1 tokens a sequence
    rides on the weights' reads until the batch is large (16: not yet measured); on a CPU every
    token costs compute, and batch 8 lost 10-20% in bench/spec.py where batch 1 won."""
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

    def record(self, drafted: int, confirmed: int, most: int) -> None:
        """After a proposal (drafted 0: none found) and the target's verdict."""
        if drafted == 0:
            self.dry += 1
            misses = self.dry
        else:
            self.dry = 0
            self.misses = misses = self.misses + 1 if confirmed == 0 else 0
            self.length = max(1, most >> self.misses)
        if misses >= PATIENCE:
            self.skip = min(2 ** (misses - PATIENCE), MAX_SKIP)


class Proposer(Protocol):
    num_tokens: int  # the most drafts it proposes for a sequence in one step

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow seq's tokens (all real ids), or none."""


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last
    n tokens (n from max_n down to min_n), in its prompt and output."""

    def __init__(self, num_tokens: int, max_n: int = 4, min_n: int = 2, window: int = 4096) -> None:
        self.num_tokens = num_tokens
        self.max_n = max_n
        self.min_n = min_n
        self.window = window  # the tokens searched, newest first: bounds the host's time per step

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(num_tokens, limit) draft tokens to follow seq's tokens, or none."""
        return self.lookup(seq.token_ids, min(self.num_tokens, limit))

    def lookup(self, token_ids: Tokens[int], k: int) -> list[int]:
        """The k tokens (or fewer) after the latest earlier occurrence of token_ids' last n."""
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
        start = max(0, length - self.window)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = list(token_ids[length - n:])
            first = tail[0]
            # The latest match that ends before the tail itself; scanned from the newest position.
            for i in range(length - n - 1, start - 1, -1):
                if token_ids[i] == first and list(token_ids[i:i + n]) == tail:
                    return list(token_ids[i + n:i + n + k])
        return []


def accepted(drafts: Tokens[int], sampled: Tokens[int]) -> int:
    """How many drafts the target's samples confirm (sampled[i] is the target's token at the
    position drafts[i] took; len(sampled) == len(drafts) + 1)."""
    count = 0
    for draft, token in zip(drafts, sampled):
        if draft != token:
            break
        count += 1
    return count
