"""The OpenAI Responses API: POST /v1/responses (streamed as typed events or not), GET and DELETE
/v1/responses/{id}.

A protocol layer over the chat path: input items become chat messages (app/responses_protocol.py),
which go through the same template, tool grammar, tool-call parser and engine request as
/v1/chat/completions; the parser's events become output items. Stored responses live in a bounded
LRU in this process (`--responses-store-size`), so `previous_response_id` works per replica.
"""
from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.chat import ChoiceTools, prepare_tools
from app.errors import APIError
from app.generation import Generation, collect, event_stream, join_choices, observed, read_json, start, state_of
from app.json import JSONResponse, dumps
from app.protocol import cache_salt
from app.responses_protocol import Item, ResponsesRequest, output_items, to_messages
from app.tools import ArgumentsDelta, ContentDelta, Event, ToolCallStart
from engine.errors import InvalidRequestError, MinillmError
from engine.outputs import RequestOutput
from engine.tokenizer import Chat


# ---- the store ------------------------------------------------------------------------------------


@dataclass
class Stored:
    response: dict[str, Any]  # the response object, as returned
    items: list[Item]  # this turn's input and output, normalized
    previous: Stored | None = None  # the turn it continued (kept alive by this one, stored or not)

    def conversation(self) -> list[Item]:
        """Every turn's items up to this one, oldest first."""
        turns, turn = [], self
        while turn is not None:
            turns.append(turn.items)
            turn = turn.previous
        return [item for items in reversed(turns) for item in items]


class ResponseStore:
    """The last `capacity` stored responses of this process; reading one makes it the newest."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 0)
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, stored: Stored) -> None:
        if self.capacity == 0:
            return
        self._entries[stored.response["id"]] = stored
        self._entries.move_to_end(stored.response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)


def store_of(request: Request) -> ResponseStore:
    return request.app.state.responses


def not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(404, f"{what} with id {response_id!r} not found.", "invalid_request_error", param=param)


# ---- output items, built from the tool parser's events ---------------------------------------------


class Output:
    """A response's output items as the parser's events arrive: text goes into a message item, each
    tool call into a function_call item. `feed` and `finish` return the stream events (type and
    fields, without sequence numbers) that say what changed."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.open: Item | None = None  # the last item, while it is still being written

    def feed(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, ContentDelta) and e.text:
                if self.open is None or self.open["type"] != "message":
                    out += self._close("completed") + self._open_message()
                self.open["content"][0]["text"] += e.text
                out.append(self._at("response.output_text.delta", content_index=0, delta=e.text, logprobs=[]))
            elif isinstance(e, ToolCallStart):
                out += self._close("completed")
                self.open = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                             "call_id": e.id, "name": e.name, "arguments": ""}
                self.items.append(self.open)
                out.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                            "item": dict(self.open)})
            elif isinstance(e, ArgumentsDelta) and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += e.text
                out.append(self._at("response.function_call_arguments.delta", delta=e.text))
        return out

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the last item with `status` ("completed" or "incomplete"). An output with no item
        at all gets an empty message, as OpenAI's does."""
        out = [] if self.items else self._open_message()
        return out + self._close(status)

    def _at(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event about the open item."""
        return {"type": kind, "item_id": self.open["id"], "output_index": len(self.items) - 1, **fields}

    def _open_message(self) -> list[dict[str, Any]]:
        self.open = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress", "role": "assistant",
                     "content": []}
        self.items.append(self.open)
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": _copy(self.open)}
        self.open["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        return [added, self._at("response.content_part.added", content_index=0, part=dict(self.open["content"][0]))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self.open
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out = [self._at("response.output_text.done", content_index=0, text=part["text"], logprobs=[]),
                   self._at("response.content_part.done", content_index=0, part=dict(part))]
        else:
            out = [self._at("response.function_call_arguments.done", arguments=item["arguments"], name=item["name"])]
        out.append({"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": _copy(item)})
        self.open = None
        return out


def _copy(item: Item) -> Item:
    """A snapshot of an item (its content parts too), for an event sent while it still changes."""
    return item | ({"content": [dict(p) for p in item["content"]]} if "content" in item else {})


# ---- the response object --------------------------------------------------------------------------


def outcome(finish_reason: str | None) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(status, incomplete_details, error) for how the sample ended."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish_reason == "abort":  # the server gave up on it (shutdown grace over)
        return "failed", None, {"code": "server_error", "message": "The request was aborted before it finished."}
    return "completed", None, None


def usage(gen: Generation) -> dict[str, Any]:
    return {"input_tokens": gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in gen.usages.values())},
            "output_tokens": gen.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def response_object(gen: Generation, body: ResponsesRequest, status: str, output: list[Item],
                    incomplete: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
                    with_usage: bool = True) -> dict[str, Any]:
    """OpenAI's response object: what was generated, and the request's settings echoed."""
    return {
        "id": gen.id, "object": "response", "created_at": gen.created, "status": status, "background": False,
        "error": error, "incomplete_details": incomplete, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": gen.model, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": (body.text.format if body.text else None) or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": [{"type": "function", "strict": True} | t.function.model_dump(exclude_none=True)
                  for t in body.function_tools()],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
        "usage": usage(gen) if with_usage else None, "user": body.user, "metadata": body.metadata or {},
    }


# ---- the routes -----------------------------------------------------------------------------------


async def create_response(request: Request) -> Response:
    state = state_of(request)
    body = ResponsesRequest.model_validate(await read_json(request, state.settings.max_body_bytes))
    state.check_model(body.model)
    body.check()
    store = store_of(request)
    previous = None
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise not_found(body.previous_response_id, "previous_response_id")
    items = body.input_items()
    history = (previous.conversation() if previous else []) + items
    if not history:
        raise InvalidRequestError("input must not be empty.", param="input")
    params, use = body.to_engine()
    params.cache_salt = cache_salt(body.cache_salt, request.headers.get("authorization"),
                                   state.settings.prefix_cache_isolation == "api-key")
    engine = state.live_engine()
    messages, tools = prepare_tools(engine, state.settings.tool_call_parser, use,
                                    body.instruction_messages() + to_messages(history), params)
    chat = Chat(messages, tools=use.tools if use else None)
    gen = Generation("chat", f"resp_{uuid.uuid4().hex}", state.settings.model_name, 1)
    outputs = observed(request, gen, await start(request, gen, [chat], params))

    def keep(response: dict[str, Any]) -> None:
        if body.store is not False:
            store.put(Stored(response, items + output_items(response["output"]), previous))

    if body.stream:
        return event_stream(response_stream(gen, body, outputs, tools, keep))
    done = await collect(request, outputs)
    if done is None:
        return Response(status_code=499)
    choices = join_choices(done, 1, {})
    text, reason = (choices[0][1].text, choices[0][1].finish_reason) if choices else ("", None)
    output = Output()
    output.feed(tools.feed(0, text, finished=True))
    status, incomplete, error = outcome(reason)
    output.finish("incomplete" if status == "incomplete" else "completed")
    response = response_object(gen, body, status, output.items, incomplete, error)
    keep(response)
    return JSONResponse(response)


async def response_stream(gen: Generation, body: ResponsesRequest, outputs: AsyncIterator[tuple[int, RequestOutput]],
                          tools: ChoiceTools, keep: Callable[[dict[str, Any]], None]) -> AsyncIterator[bytes]:
    """The typed events: response.created and .in_progress; per output item its added, content and
    done events; then response.completed, .incomplete or .failed. Each is `event:` and `data:`
    lines, numbered by sequence_number."""
    numbers = itertools.count()

    def event(fields: dict[str, Any]) -> bytes:
        data = {"type": fields["type"], "sequence_number": next(numbers), **fields}
        return b"event: " + fields["type"].encode() + b"\ndata: " + dumps(data) + b"\n\n"

    output = Output()
    started = response_object(gen, body, "in_progress", [], with_usage=False)
    reason = None
    async with aclosing(outputs):  # stopping early (client gone) closes the source: aborts at once
        yield event({"type": "response.created", "response": started})
        yield event({"type": "response.in_progress", "response": started})
        try:
            async for _, out in outputs:
                for d in out.deltas:
                    reason = d.finish_reason or reason
                    for e in output.feed(tools.feed(0, d.text, finished=d.finish_reason is not None)):
                        yield event(e)
        except MinillmError as e:  # the engine died mid-stream: the response failed
            error = {"code": "server_error", "message": e.message}
            yield event({"type": "response.failed", "response": response_object(gen, body, "failed", output.items,
                                                                                  error=error)})
            return
    status, incomplete, error = outcome(reason)
    for e in output.finish("incomplete" if status == "incomplete" else "completed"):
        yield event(e)
    response = response_object(gen, body, status, output.items, incomplete, error)
    keep(response)
    yield event({"type": f"response.{status}", "response": response})


async def get_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    stored = store_of(request).get(response_id)
    if stored is None:
        raise not_found(response_id)
    return JSONResponse(stored.response)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not store_of(request).delete(response_id):
        raise not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
