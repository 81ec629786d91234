"""POST /v1/chat/completions: messages through the chat template, streamed or not, with tool calls
and structured output.

Tool calls: the model's tool-call format is chosen from its chat template (app/tools/); unless
tool_choice is "none", a grammar from that format constrains the output (free text, then only valid
calls of declared tools), and a parser per choice turns the text into content and `tool_calls`.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.errors import typed_error_body
from app.generation import Generation, collect, event_stream, join_choices, observed, read_json, start, state_of
from app.json import SSE_DONE, JSONResponse, sse
from app.protocol import ChatCompletionRequest, ToolUse, cache_salt
from app.tools import ArgumentsDelta, ContentDelta, Event, ToolCallParser, ToolCallStart, ToolFormat, format_for
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError, MinillmError
from engine.outputs import RequestOutput
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.tokenizer import Chat


def chat_logprobs(engine: AsyncEngine, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = engine.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


# ---- tools: the prompt, the grammar and the parsers ----------------------------------------------


def with_tools(fmt: ToolFormat, use: ToolUse, messages: list[dict[str, Any]], params: SamplingParams) -> list[dict[str, Any]]:
    """Constrain params to the tool-call grammar of `fmt` (with tool_choice auto and a JSON response
    format: either calls or that JSON), and give a template that knows no tools their description
    and the earlier calls as text."""
    answer_format = params.structured if use.choice == "auto" else None  # required/named: calls only
    if answer_format is None:
        grammar = fmt.grammar(use.tools, use.choice, use.parallel)
    else:  # calls from the first character, or the JSON answer: free text would escape both
        grammar = _either(fmt.grammar(use.tools, "required", use.parallel), answer_format)
    params.structured = StructuredOutput("structural_tag", grammar, param="tools")
    params.skip_special_tokens = False  # call markers may be special tokens ([TOOL_CALLS], <|python_tag|>)
    if (prompt := fmt.system_prompt(use.tools, use.choice, use.parallel)) is None:
        return messages
    if answer_format is not None:
        prompt += "\nIf you call no tool, reply with the JSON answer only."
    messages = [_calls_as_text(fmt, m) for m in messages]
    if messages[0]["role"] == "system":
        return [messages[0] | {"content": messages[0]["content"] + "\n\n" + prompt}] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages


def _calls_as_text(fmt: ToolFormat, message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's earlier calls written into its content, as the model would write them."""
    if not message.get("tool_calls"):
        return message
    calls = [{"function": {"name": c["function"]["name"], "arguments": a if isinstance(a := c["function"]["arguments"], str)
                           else json.dumps(a)}} for c in message["tool_calls"]]
    text = "\n".join(t for t in (message["content"], fmt.render_calls(calls)) if t)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def _either(tool_grammar: str, response: StructuredOutput) -> str:
    """A structural tag that takes the tool calls or the response format's JSON."""
    if response.kind not in ("json", "json_object"):
        raise InvalidRequestError("With tools, only a JSON response format can be combined.", param=response.param)
    schema = json.loads(response.spec) if response.kind == "json" else {"type": "object"}
    tag = json.loads(tool_grammar)
    tag["format"] = {"type": "or", "elements": [tag["format"], {"type": "json_schema", "json_schema": schema}]}
    return json.dumps(tag)


class ChoiceTools:
    """Per choice, a parser of the output into content and tool calls (None: no tools, text as is)."""

    def __init__(self, fmt: ToolFormat | None) -> None:
        self.fmt = fmt
        self.parsers: dict[int, ToolCallParser] = {}

    def feed(self, index: int, text: str, finished: bool) -> list[Event]:
        if self.fmt is None:
            return [ContentDelta(text)] if text else []
        parser = self.parsers.setdefault(index, self.fmt.parser())
        events = parser.feed(text) if text else []
        return events + parser.finish() if finished else events

    def called(self, index: int) -> bool:
        return index in self.parsers and bool(self.parsers[index].calls)

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        """"tool_calls" for a choice that called tools and ended by itself."""
        return "tool_calls" if reason == "stop" and self.called(index) else reason


def message(tools: ChoiceTools, index: int, text: str) -> dict[str, Any]:
    """A non-streamed choice's assistant message."""
    events = tools.feed(index, text, finished=True)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    if not tools.called(index):
        return {"role": "assistant", "content": content}
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in tools.parsers[index].calls]
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


def delta_of(events: list[Event]) -> dict[str, Any]:
    """One chunk's delta from parser events: content joined, tool calls in OpenAI's stream shape
    (index, id, type and name first; then argument fragments)."""
    delta: dict[str, Any] = {}
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, ContentDelta):
            delta["content"] = delta.get("content", "") + e.text
        elif isinstance(e, ToolCallStart):
            calls.append({"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, ArgumentsDelta):
            if calls and calls[-1]["index"] == e.index:
                calls[-1]["function"]["arguments"] += e.text
            else:
                calls.append({"index": e.index, "function": {"arguments": e.text}})
    if calls:
        delta["tool_calls"] = calls
    return delta


def prepare_tools(engine: AsyncEngine, parser: str | None, use: ToolUse | None, messages: list[dict[str, Any]],
                  params: SamplingParams) -> tuple[list[dict[str, Any]], ChoiceTools]:
    """The messages with the tools' prompt, params constrained to their grammar, and the parser of the
    reply (no tools, or tool_choice "none": the text as is). `parser` is --tool-call-parser."""
    fmt = None
    if use is not None and use.choice != "none":
        fmt = format_for(engine.chat_template, parser)
        messages = with_tools(fmt, use, messages, params)
    return messages, ChoiceTools(fmt)


# ---- the route ------------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    body = ChatCompletionRequest.model_validate(await read_json(request, state.settings.max_body_bytes))
    state.check_model(body.model)
    messages, params, use = body.to_engine()
    params.cache_salt = cache_salt(body.cache_salt, request.headers.get("authorization"),
                                   state.settings.prefix_cache_isolation == "api-key")
    engine = state.live_engine()
    messages, tools = prepare_tools(engine, state.settings.tool_call_parser, use, messages, params)
    chat = Chat(messages, tools=use.tools if use else None, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message)
    gen = Generation("chat", f"chatcmpl-{uuid.uuid4().hex}", state.settings.model_name, params.n)
    outputs = observed(request, gen, await start(request, gen, [chat], params))
    want_logprobs = params.logprobs is not None
    if body.stream:
        return event_stream(chat_stream(engine, gen, outputs, body.include_usage, want_logprobs, tools))
    items = await collect(request, outputs)
    if items is None:
        return Response(status_code=499)
    return JSONResponse(gen.head("chat.completion") | {
        "choices": [{"index": k, "message": message(tools, k, c.text),
                     "logprobs": chat_logprobs(engine, c.logprobs) if want_logprobs else None,
                     "finish_reason": tools.finish_reason(k, c.finish_reason)}
                    for k, c in join_choices(items, gen.n, {})],
        "usage": gen.usage(),
    })


async def chat_stream(engine: AsyncEngine, gen: Generation, outputs: AsyncIterator[tuple[int, RequestOutput]],
                      include_usage: bool, want_logprobs: bool, tools: ChoiceTools) -> AsyncIterator[bytes]:
    """OpenAI's chunk format: one id; role on each choice's first chunk; no empty chunks;
    finish_reason only on each choice's last; usage alone in a final chunk when asked."""
    head = gen.head("chat.completion.chunk")
    extra = {"usage": None} if include_usage else {}
    opened: set[int] = set()
    pending_logprobs: dict[int, list[TokenLogprobs]] = {}
    try:
        async with aclosing(outputs):  # stopping early closes the source: aborts at once
            async for _, out in outputs:
                for d in out.deltas:
                    pending_logprobs.setdefault(d.index, []).extend(d.logprobs or [])
                    delta = delta_of(tools.feed(d.index, d.text, finished=d.finish_reason is not None))
                    if not delta and not d.finish_reason:
                        continue  # nothing to show yet (text held back): no empty chunks
                    if d.index not in opened:
                        opened.add(d.index)
                        content = delta.pop("content", None if "tool_calls" in delta else "")
                        delta = {"role": "assistant", "content": content} | delta
                    lps = pending_logprobs.pop(d.index, [])
                    choice = {"index": d.index, "delta": delta,
                              "logprobs": chat_logprobs(engine, lps) if want_logprobs else None,
                              "finish_reason": tools.finish_reason(d.index, d.finish_reason)}
                    yield sse(head | {"choices": [choice]} | extra)
        if include_usage:
            yield sse(head | {"choices": [], "usage": gen.usage()})
    except MinillmError as e:  # the engine died mid-stream: say so in the stream, then end it
        yield sse(typed_error_body(e))
    yield SSE_DONE
