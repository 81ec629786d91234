"""OpenAI request bodies (pydantic, unknown fields ignored) and how they map onto SamplingParams."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams


class _Body(BaseModel):
    # Clients send new fields before servers know them: accept and ignore.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _Sampling(_Body):
    """Fields both endpoints share, with OpenAI's names and defaults, plus vLLM's common extras."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extras (vLLM's names).
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true.", param="stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Build and validate engine params (raises InvalidRequestError naming the param)."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias") from None
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=bias or None,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Features not built yet: present (and not trivially off) means a clear 400.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def to_engine(self) -> tuple[list[dict[str, str]], SamplingParams]:
        self.check_common()
        for param in ("tools", "functions"):
            if getattr(self, param):
                raise InvalidRequestError(f"{param} are not supported by this server yet.", param=param)
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            param = "tool_choice" if self.tool_choice not in (None, "none") else "function_call"
            raise InvalidRequestError(f"{param} is not supported by this server yet.", param=param)
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("Only response_format type 'text' is supported yet.", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs to be true.", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError(f"{param} must be at least 1, got {max_tokens}.", param=param)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    | ({"name": m.name} if m.name else {}) for m in self.messages]
        return messages, self.sampling_params(max_tokens, logprobs)


PromptInput = str | list[str] | list[int] | list[list[int]]
MAX_PROMPTS = 256  # each prompt is a request (times n): bound what one call can queue


class CompletionRequest(_Sampling):
    prompt: PromptInput
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: PromptInput) -> PromptInput:
        if not prompt or (isinstance(prompt, list) and any(isinstance(p, (str, list)) and not p for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """One engine prompt per entry: a string, a list of strings, token ids or lists of them."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]

    def to_engine(self) -> tuple[list[str | list[int]], SamplingParams]:
        self.check_common()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported.", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of other than n is not supported.", param="best_of")
        if isinstance(self.prompt, list) and len(self.prompts()) > MAX_PROMPTS:
            raise InvalidRequestError(f"At most {MAX_PROMPTS} prompts in one request.", param="prompt")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo together with logprobs is not supported yet.", param="echo")
        return self.prompts(), self.sampling_params(self.max_tokens, self.logprobs)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
