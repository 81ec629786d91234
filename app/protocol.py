"""OpenAI request bodies (pydantic, unknown fields ignored) and how they map onto SamplingParams."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from app.json import dumps as orjson_dumps, loads as orjson_loads
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, StructuredOutput, seed_out_of_range


class _Body(BaseModel):
    # Clients send new fields before servers know them: accept and ignore.
    model_config = ConfigDict(extra="ignore")


# An empty model name means the served model, as an omitted one does.
ModelName = Annotated[str | None, BeforeValidator(lambda v: None if v == "" else v)]


def _seed(value: Any) -> Any:
    """JSON integers past 64 bits reach us as floats (orjson), rounded: -2**63 - 1 reads as -2**63. An
    integer that fits always comes as an int, so a float at or past either bound is out of range."""
    if isinstance(value, float) and abs(value) >= 2**63:
        raise seed_out_of_range(value)
    return value


Seed = Annotated[int | None, BeforeValidator(_seed)]
# vLLM's cache_salt: only requests with the same salt share prefix-cache blocks.
CacheSalt = Annotated[str | None, Field(min_length=1)]


def cache_salt(salt: str | None, authorization: str | None, by_api_key: bool) -> str | None:
    """A request's prefix-cache salt: its cache_salt, led under --prefix-cache-isolation api-key by a
    digest of the caller's Authorization header (the key itself is kept nowhere), so no tenant's
    timing shows whether another sent a prompt. The digest has a fixed length: no salt poses as it."""
    if not by_api_key:
        return salt
    key = hashlib.sha256((authorization or "").encode("utf-8", "surrogatepass")).hexdigest()
    return key if salt is None else f"{key}:{salt}"


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it: developer is system, content is text, and a
        call's arguments are an object (templates serialize them themselves)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out


def _arguments(text: str) -> Any:
    try:
        return orjson_loads(text)
    except ValueError:
        return text  # not JSON: the template gets the text as sent


class FunctionDefinition(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition

    def to_template(self) -> dict[str, Any]:
        """OpenAI's tool dict, with an object schema where none was given."""
        function = self.function.model_dump(exclude_none=True)
        function.setdefault("parameters", {"type": "object", "properties": {}})
        return {"type": "function", "function": function}


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class JSONSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None


class _Sampling(_Body):
    """Fields both endpoints share, with OpenAI's names and defaults, plus vLLM's common extras."""

    model: ModelName = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed = None
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
    cache_salt: CacheSalt = None
    # Structured outputs, vLLM's names: the current one and the older guided_* fields.
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        """A final usage chunk is asked for (streams only)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true.", param="stream_options")

    def extra_grammars(self) -> list[StructuredOutput]:
        """The grammars the vLLM extras ask for (at most one may be given, checked by the caller)."""
        found = []
        so = self.structured_outputs
        for param, kind, value in (
            ("structured_outputs.json", "json", so and so.json_), ("structured_outputs.regex", "regex", so and so.regex),
            ("structured_outputs.choice", "choice", so and so.choice),
            ("structured_outputs.grammar", "grammar", so and so.grammar),
            ("structured_outputs.json_object", "json_object", so and so.json_object),
            ("structured_outputs.structural_tag", "structural_tag", so and so.structural_tag),
            ("guided_json", "json", self.guided_json), ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice), ("guided_grammar", "grammar", self.guided_grammar),
        ):
            if value is None or value is False:
                continue
            if kind == "choice":
                if not value:
                    raise InvalidRequestError(f"{param} must list at least one choice.", param=param)
                found.append(StructuredOutput.choice(value, param))
            elif kind == "json":
                found.append(StructuredOutput.json_schema(value, param))
            elif kind == "json_object":
                found.append(StructuredOutput("json_object", "", param))
            else:
                found.append(StructuredOutput(kind, value if isinstance(value, str) else orjson_dumps(value).decode(), param))
        return found

    @staticmethod
    def one_grammar(grammars: list[StructuredOutput]) -> StructuredOutput | None:
        if len(grammars) > 1:
            names = ", ".join(g.param for g in grammars)
            raise InvalidRequestError(f"Give at most one output constraint; got {names}.", param=grammars[1].param)
        return grammars[0] if grammars else None

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


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass
class ToolUse:
    """What a chat request asks of tools: their OpenAI definitions, and which may or must be called."""

    tools: list[dict[str, Any]]
    choice: str  # "none", "auto", "required", or the name of the one function to call
    parallel: bool  # more than one call in a turn


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # The deprecated function-calling fields: still refused clearly (use tools).
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM's chat template extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def to_engine(self) -> tuple[list[dict[str, Any]], SamplingParams, ToolUse | None]:
        self.check_common()
        if self.functions or self.function_call not in (None, "none"):
            param = "functions" if self.functions else "function_call"
            raise InvalidRequestError(f"{param} is deprecated and not supported; use tools and tool_choice.", param=param)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs to be true.", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError(f"{param} must be at least 1, got {max_tokens}.", param=param)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self.sampling_params(max_tokens, logprobs)
        params.structured = self.one_grammar(self.response_grammars() + self.extra_grammars())
        return [m.to_template() for m in self.messages], params, self.tool_use()

    def response_grammars(self) -> list[StructuredOutput]:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return []
        if rf.type == "json_object":
            return [StructuredOutput("json_object", "", "response_format")]
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError("response_format json_schema needs json_schema.schema.",
                                      param="response_format.json_schema")
        return [StructuredOutput.json_schema(rf.json_schema.schema_, "response_format.json_schema.schema")]

    def tool_use(self) -> ToolUse | None:
        """The tools and the choice among them; None when there are no tools."""
        return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)


def tool_use(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolUse | None:
    """What a request asks of its tools (chat and Responses alike); None when there are no tools."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools.", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("Tool names must be unique.", param="tools")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        if name not in names:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools.", param="tool_choice")
        choice = name
    return ToolUse([t.to_template() for t in tools], choice or "auto", True if parallel is None else parallel)


PromptInput = str | list[str] | list[int] | list[list[int]]
MAX_PROMPTS = 256  # each prompt is a request (times n): bound what one call can queue
COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions (chat's: the context)
# Null too means the default: a client sending it must not run to the end of the context.
CompletionMaxTokens = Annotated[int | None, BeforeValidator(lambda v: COMPLETION_MAX_TOKENS if v is None else v)]


class CompletionRequest(_Sampling):
    prompt: PromptInput
    max_tokens: CompletionMaxTokens = COMPLETION_MAX_TOKENS
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

    @property
    def scoring_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone (with its logprobs, if asked), as in
        OpenAI's and vLLM's API."""
        return self.echo and self.max_tokens == 0

    def to_engine(self) -> tuple[list[str | list[int]], SamplingParams]:
        self.check_common()
        # Scoring only: the engine samples one token (from the prefill's logits: no extra step), left out of the answer.
        params = self.sampling_params(1 if self.scoring_only else self.max_tokens, self.logprobs)
        if self.echo:
            params.prompt_logprobs = self.logprobs  # the echoed prompt's tokens come with logprobs too
        params.structured = self.one_grammar(self.extra_grammars())
        if self.suffix:
            raise InvalidRequestError("suffix is not supported.", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of other than n is not supported.", param="best_of")
        if isinstance(self.prompt, list) and len(self.prompts()) > MAX_PROMPTS:
            raise InvalidRequestError(f"At most {MAX_PROMPTS} prompts in one request.", param="prompt")
        return self.prompts(), params


class TokenizeRequest(_Body):
    model: ModelName = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    # With messages: what the chat template also takes.
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Body):
    model: ModelName = None
    tokens: list[int]
