"""The Responses API's request body (pydantic, unknown fields ignored) and how it maps onto the chat
path: input items → chat messages, flat function tools → `ToolUse`, text.format → a grammar.

Conversation items are kept in one normalized form (what `input_items` returns and the store keeps):

    {"type": "message", "role": "user" | "system" | "developer" | "assistant", "content": str}
    {"type": "function_call", "call_id": str, "name": str, "arguments": str}
    {"type": "function_call_output", "call_id": str, "output": str}
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from app.errors import param_of
from app.protocol import (CacheSalt, FunctionCall, FunctionDefinition, Message, ModelName, NamedToolChoice, Tool,
                          ToolCall, ToolUse, _Body, tool_use)
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, StructuredOutput

Item = dict[str, Any]
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "system", "developer", "assistant")
IGNORED_ITEMS = ("reasoning",)  # we never write reasoning: a client replaying OpenAI's output may send it back


class TextConfig(_Body):
    format: dict[str, Any] | None = None


class ResponsesRequest(_Body):
    model: ModelName = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None
    stream: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    cache_salt: CacheSalt = None  # vLLM's extra, as on chat
    # Refused with a 400 naming them: features of OpenAI's platform this server does not have.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # `reasoning`, `include`, `truncation` and the rest are accepted and ignored (extra="ignore").

    def check(self) -> None:
        for param, value in (("background", self.background), ("conversation", self.conversation),
                             ("prompt", self.prompt)):
            if value:
                raise InvalidRequestError(f"{param} is not supported by this server.", param=param)
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidRequestError(f"max_output_tokens must be at least 1, got {self.max_output_tokens}.",
                                      param="max_output_tokens")

    def input_items(self) -> list[Item]:
        """The input as normalized items (a string is one user message); 400 naming the bad item."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [_item(raw, f"input[{i}]") for i, raw in enumerate(self.input)
                if not (isinstance(raw, dict) and raw.get("type") in IGNORED_ITEMS)]

    def instruction_messages(self) -> list[dict[str, Any]]:
        """instructions as the first system message (never stored: each request gives its own)."""
        return [{"role": "system", "content": self.instructions}] if self.instructions else []

    def function_tools(self) -> list[Tool]:
        """The flat function tools as the chat path's Tool; a built-in tool is a 400 naming it."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise InvalidRequestError(f"Tool type {kind!r} is not supported: only function tools (no built-in "
                                          "tools such as web search).", param=f"tools[{i}].type")
            fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            tools.append(Tool(type="function", function=_validated(FunctionDefinition, fields, f"tools[{i}]")))
        return tools

    def tool_use(self) -> ToolUse | None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                          '"name": ...}.', param="tool_choice")
            choice = NamedToolChoice(function={"name": choice["name"]})
        elif choice not in (None, "none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice {choice!r} is not supported.", param="tool_choice")
        return tool_use(self.function_tools(), choice, self.parallel_tool_calls)

    def grammar(self) -> StructuredOutput | None:
        """text.format as the chat path's response format."""
        fmt = (self.text.format if self.text else None) or {"type": "text"}
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutput("json_object", "", "text.format")
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise InvalidRequestError("text.format json_schema needs a schema object.", param="text.format.schema")
            return StructuredOutput.json_schema(fmt["schema"], "text.format.schema")
        raise InvalidRequestError(f"text.format type {kind!r} is not supported: text, json_object or json_schema.",
                                  param="text.format.type")

    def to_engine(self) -> tuple[SamplingParams, ToolUse | None]:
        params = SamplingParams(max_tokens=self.max_output_tokens,
                                temperature=1.0 if self.temperature is None else self.temperature,
                                top_p=1.0 if self.top_p is None else self.top_p, structured=self.grammar())
        return params, self.tool_use()


def _validated(model: type[_Body], data: dict[str, Any], param: str) -> Any:
    """model.model_validate(data), its error a 400 whose param starts with `param`."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = param_of(tuple(first["loc"]))
        full = f"{param}.{where}" if where else param
        raise InvalidRequestError(f"Invalid value for {full}: {first['msg']}.", param=full) from None


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        problem = "is missing" if value is None else "must be a string"
        raise InvalidRequestError(f"{param}.{key} {problem}.", param=f"{param}.{key}")
    return value


def _text(content: Any, param: str) -> str:
    """A message's (or a tool output's) content as text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param} must be a string or a list of content parts.", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            texts.append(_string(part, "text", f"{param}[{j}]"))
        elif kind == "refusal":
            texts.append(_string(part, "refusal", f"{param}[{j}]"))
        else:
            raise InvalidRequestError(f"Content part type {kind!r} is not supported: only text (input_text, "
                                      "output_text).", param=f"{param}[{j}].type")
    return "".join(texts)


def _item(raw: Any, param: str) -> Item:
    """One input item, normalized (see the module docstring)."""
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{param} must be an object.", param=param)
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind == "message":
        role = raw.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{param}.role must be one of {', '.join(ROLES)}.", param=f"{param}.role")
        return {"type": "message", "role": role, "content": _text(raw.get("content"), f"{param}.content")}
    if kind == "function_call":
        return {"type": "function_call", "call_id": _string(raw, "call_id", param), "name": _string(raw, "name", param),
                "arguments": _string(raw, "arguments", param)}
    if kind == "function_call_output":
        return {"type": "function_call_output", "call_id": _string(raw, "call_id", param),
                "output": _text(raw.get("output"), f"{param}.output")}
    raise InvalidRequestError(f"Input item type {kind!r} is not supported: message, function_call or "
                              "function_call_output.", param=f"{param}.type")


def output_items(output: list[Item]) -> list[Item]:
    """A response's output items, normalized to be the next turn's history."""
    items = []
    for o in output:
        if o["type"] == "message":
            items.append({"type": "message", "role": "assistant", "content": "".join(p["text"] for p in o["content"])})
        else:
            items.append({k: o[k] for k in ("type", "call_id", "name", "arguments")})
    return items


def to_messages(items: list[Item]) -> list[dict[str, Any]]:
    """Normalized items as chat-template messages, through the chat path's Message: an assistant
    message and the function calls right after it are one assistant turn with tool_calls."""
    messages: list[Message] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append(Message(role=item["role"], content=item["content"]))
        elif kind == "function_call":
            call = ToolCall(id=item["call_id"], function=FunctionCall(name=item["name"], arguments=item["arguments"]))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = (last.tool_calls or []) + [call]
            else:
                messages.append(Message(role="assistant", content=None, tool_calls=[call]))
        else:
            messages.append(Message(role="tool", content=item["output"], tool_call_id=item["call_id"]))
    return [m.to_template() for m in messages]
