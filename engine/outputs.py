"""What the engine sends back through each request's channel, step by step."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampler import TokenLogprobs


@dataclass
class SampleDelta:
    """What one sample (choice) gained in one step."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop", "length" or "abort", on the sample's last delta only
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
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


@dataclass
class RequestOutput:
    request_id: str
    deltas: list[SampleDelta] = field(default_factory=list)
    usage: Usage | None = None
    finished: bool = False
    prompt_token_ids: list[int] = field(default_factory=list)
    times: RequestTimes | None = None  # on the finished output only
