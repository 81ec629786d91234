"""A request and its sequences: the token streams the scheduler moves between queues."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar_worker import Grammar
    from engine.sampler import TokenLogprobs
    from engine.speculative import DraftState
    from engine.tokenizer import IncrementalDetokenizer

_seq_ids = itertools.count()


def placeholder(row: int) -> int:
    """The token id standing for row `row` of the step still being sampled on the device."""
    return -1 - row


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sample of a request: prompt + generated tokens, its KV blocks and its progress."""

    request: "Request"
    index: int  # the choice index within its request (0..n-1)
    token_ids: list[int]
    seed: int  # key of this sample's randomness, with the position of each token
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks
    finish_reason: str | None = None
    detokenizer: "IncrementalDetokenizer | None" = None
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    # Trailing token ids not yet real: placeholders for ids still being sampled on the device, and the
    # drafts of a step in flight (LLMEngine._launch), until that step is read.
    num_placeholders: int = 0
    grammar: "Grammar | None" = None  # where this sample is in its request's grammar, if it has one
    drafting: "DraftState | None" = None  # under speculation: how it drafts next

    @property
    def num_real_tokens(self) -> int:
        return len(self.token_ids) - self.num_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


@dataclass(eq=False)
class Request:
    """What a client asked for: a prompt, its controls, and n sequences once they exist."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what the context leaves
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # With params.prompt_logprobs: the prompt positions whose logprobs are launched (a recompute
    # after preemption skips them), and those collected, for positions 1, 2, ...
    prompt_logprobs_launched: int = 1
    prompt_logprobs: list["TokenLogprobs"] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_pending_forks(self) -> int:
        """Samples not yet forked from the first (they share its prompt blocks once it is prefilled)."""
        return self.params.n - len(self.sequences)

    @property
    def is_finished(self) -> bool:
        if self.num_pending_forks:
            return False
        for s in self.sequences:  # once per request and step: a plain loop, no generator
            if s.status != SequenceStatus.FINISHED:
                return False
        return True
