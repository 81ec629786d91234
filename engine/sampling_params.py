"""Per-request generation controls, with OpenAI's names and limits."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
MAX_N = 128  # each sample is a sequence made at once: an unbounded n is an out-of-memory kill
SEED_RANGE = (-(2**63), 2**63 - 1)  # OpenAI's (a signed 64-bit integer), as vLLM checks it
GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def seed_out_of_range(seed: float) -> InvalidRequestError:
    return InvalidRequestError(f"seed must be a signed 64-bit integer, in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] as in "
                               f"OpenAI's API, got {seed}.", param="seed")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. `kind` is one of GRAMMAR_KINDS; `spec` is its text: a JSON
    schema, a regex, a JSON list of choices, an EBNF (GBNF) or Lark grammar, or an xgrammar
    structural tag. `param` names the request field it came from, for error messages."""

    kind: str
    spec: str = ""
    param: str = field(default="response_format", compare=False)

    @classmethod
    def json_schema(cls, schema: object, param: str = "response_format") -> "StructuredOutput":
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema), param)

    @classmethod
    def choice(cls, choices: list[str], param: str = "guided_choice") -> "StructuredOutput":
        return cls("choice", json.dumps(list(choices)), param)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. `validate()` raises InvalidRequestError naming the param."""

    n: int = 1
    max_tokens: int | None = None  # None: until the context is full
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; 0: the sampled token's only; k: also the k most likely (k <= 20).
    logprobs: int | None = None
    # The same for each prompt token after the first (completions' echo with logprobs). Every
    # prompt position is computed for it: such a prompt takes nothing from the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # a grammar the output must match
    # Not sampling, but carried with the request's controls: only requests with the same salt share
    # prefix-cache blocks (mixed into the first block's hash), so one tenant cannot time another's prompts.
    cache_salt: str | None = None

    @property
    def penalized(self) -> bool:
        """Whether sampling reads the tokens generated so far."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"n must be in [1, {MAX_N}], got {self.n}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise seed_out_of_range(self.seed)
        if self.cache_salt is not None and not self.cache_salt:
            raise bad("cache_salt", "cache_salt must be a non-empty string if given.")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise bad("top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}.")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}.")
        if len(self.stop) > 16 or any(not s for s in self.stop):
            raise bad("stop", "stop takes at most 16 non-empty strings.")
        for token_id, bias in (self.logit_bias or {}).items():
            if vocab_size is not None and not 0 <= int(token_id) < vocab_size:
                raise bad("logit_bias", f"logit_bias has token id {token_id} outside the vocabulary.")
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias}.")
        if self.structured is not None and self.structured.kind not in GRAMMAR_KINDS:
            raise bad(self.structured.param, f"Unknown grammar kind {self.structured.kind!r}.")
        for token_id in self.stop_token_ids:
            if vocab_size is not None and not 0 <= token_id < vocab_size:
                raise bad("stop_token_ids", f"stop_token_ids has token id {token_id} outside the vocabulary.")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
