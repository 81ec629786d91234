"""What the engine sends back through each request's channel, step by step."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampler import TokenLogprobs


@dataclass(slots=True)
class SampleDelta:
    """What one sample (choice) gained in one step."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop", "length" or "abort", on the sample's last delta only
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RequestTimes:
    """Where a finished request's time went (seconds, from the engine's monotonic clock)."""

    queue: float  # arrival -> first scheduled
    prefill: float  # first scheduled -> first token
    decode: float  # first token -> finished
    total: float  # arrival -> finished


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    deltas: list[SampleDelta] = field(default_factory=list)
    usage: Usage | None = None
    finished: bool = False
    prompt_token_ids: list[int] = field(default_factory=list)
    times: RequestTimes | None = None  # on the finished output only
    # With params.prompt_logprobs, on the request's first output: None for the first prompt token
    # (nothing predicts it), then each later prompt token's logprob and top alternatives.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def merge(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by a later one of the same request, as one (for a reader that fell
        behind: one message instead of several)."""
        by_index = {d.index: d for d in self.deltas}
        for d in later.deltas:
            if (first := by_index.get(d.index)) is None:
                by_index[d.index] = first = SampleDelta(d.index, [], "", None)
                self.deltas.append(first)
            first.token_ids = first.token_ids + d.token_ids
            first.text += d.text
            if d.logprobs is not None:
                first.logprobs = (first.logprobs or []) + d.logprobs
            first.finish_reason, first.stop_reason = d.finish_reason or first.finish_reason, d.stop_reason or first.stop_reason
        self.usage = later.usage or self.usage
        self.finished = later.finished
        self.times = later.times or self.times
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        return self
