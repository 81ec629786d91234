"""The Responses API (/v1/responses) through the official openai SDK against the shared server (the
embedded SmolLM2): responses non-streamed and streamed (typed events, the SDK's stream helper),
text.format, function tools across turns (previous_response_id or the history sent again),
max_output_tokens, the store, a client that leaves mid-stream, and bad input."""
from __future__ import annotations

import json
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from app.responses import ResponseStore, Stored
from tests.app.conftest import MODEL_NAME, Server
from tests.app.test_http import engine_idle, metric, scrape, wait_until

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
ASK = "What is the weather in Paris?"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
RESULT = '{"temperature": 21, "sky": "clear"}'


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(client: openai.OpenAI, **kw):
    return client.responses.create(**{"model": MODEL_NAME, "temperature": 0} | kw)


def test_create_stores_the_response(client) -> None:
    r = create(client, instructions="Answer briefly.", input="Say hello.", max_output_tokens=8, metadata={"k": "v"},
               user="u1", reasoning={"effort": "low"}, extra_body={"a_field_from_the_future": 1})
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.output_text and r.output_text == message.content[0].text
    u = r.usage
    assert 0 < u.output_tokens <= 8 and u.input_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0
    assert (r.metadata, r.user, r.instructions, r.store) == ({"k": "v"}, "u1", "Answer briefly.", True)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = create(client, input="Say hello.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_stream_events_come_in_order_and_join_to_the_response(client) -> None:
    kw = {"input": "Name three colours.", "max_output_tokens": 12}
    events = list(create(client, stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas > 1 and types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", f"response.{events[-1].response.status}"]
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text and len({e.response.id for e in events[:2]} | {final.id}) == 1
    whole = create(client, **kw)
    assert whole.output_text == text and whole.status == final.status
    assert client.responses.retrieve(final.id).output_text == text  # the streamed one is stored too


def test_stream_helper_parses_the_text_format(client) -> None:
    with client.responses.stream(model=MODEL_NAME, input="Is it sunny in Paris? Answer in JSON.", text_format=Weather,
                                 temperature=0, max_output_tokens=40) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Weather) and "".join(deltas) == final.output_text


@pytest.mark.parametrize("fmt", [{"type": "json_schema", "name": "person", "schema": PERSON, "strict": True},
                                 {"type": "json_object"}], ids=["json_schema", "json_object"])
def test_text_format_output_validates(client, fmt) -> None:
    ask = "Invent a person as JSON." if fmt["type"] == "json_schema" else 'Reply with the JSON object {"ok": true}.'
    r = create(client, input=ask, text={"format": fmt}, max_output_tokens=60)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON if fmt["type"] == "json_schema" else {"type": "object"})


def test_function_tool_round_trip(client) -> None:
    ask = {"input": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
           "parallel_tool_calls": False, "max_output_tokens": 60}
    first = create(client, **ask)
    [call] = first.output
    assert first.status == "completed" and call.type == "function_call" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(create(client, stream=True, **ask))
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert types[-4:] == ["response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    joined = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert joined == events[-3].arguments == call.arguments  # greedy: the same call as the whole one

    result = [{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    answer = {"tools": [WEATHER], "tool_choice": "none", "max_output_tokens": 12}
    linked = create(client, previous_response_id=first.id, input=result, **answer)
    assert linked.previous_response_id == first.id and linked.output_text
    assert [o.type for o in linked.output] == ["message"]
    assert linked.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, from the prefix cache
    history = [{"role": "user", "content": ASK}] + [o.model_dump(exclude_none=True) for o in first.output] + result
    sent = create(client, input=history, **answer)
    assert (sent.usage.input_tokens, sent.output_text) == (linked.usage.input_tokens, linked.output_text)


def test_max_output_tokens_gives_incomplete(client) -> None:
    kw = {"input": "Write a long story about a dragon.", "max_output_tokens": 3}
    r = create(client, **kw)
    assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    assert r.output[0].status == "incomplete"
    last = list(create(client, stream=True, **kw))[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == r.output_text


def test_client_disconnect_mid_stream_aborts_the_request(server: Server) -> None:
    wait_until(lambda: engine_idle(server), 1.0)
    body = {"input": "Count from 1 to 1000, separated by commas.", "max_output_tokens": 2000, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            deltas = 0
            lines = r.iter_lines()  # held: httpx closes the connection when a dropped iterator is collected
            for line in lines:
                deltas += line == "event: response.output_text.delta"
                if deltas == 3:
                    break
            m = scrape(server)
            assert metric(m, "minillm_requests_running") == 1 and metric(m, "minillm_kv_cache_used_bytes") > 0
    # The connection is closed here: the server must abort and free the KV blocks at once.
    wait_until(lambda: engine_idle(server), 1.0)
    generated = metric(scrape(server), "minillm_tokens_generated_total")
    time.sleep(0.2)
    assert metric(scrape(server), "minillm_tokens_generated_total") == generated


def test_bad_input_gets_openai_errors_and_the_engine_keeps_serving(client) -> None:
    cases = [
        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "output": RESULT}]}, "input[0].call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
         "input[0].content[0].type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [WEATHER | {"name": "no spaces allowed"}]}, "tools[0].name"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "missing"}}, "tool_choice"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
         "text.format.schema"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            create(client, **kw)
        assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error", (kw, e.value.body)
    with pytest.raises(openai.NotFoundError) as e:
        create(client, input="x", previous_response_id="resp_missing")
    assert e.value.body["param"] == "previous_response_id"
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call("resp_missing")
    assert create(client, input="Say hi.", max_output_tokens=2).output_text


def test_store_keeps_the_most_recently_used() -> None:
    store = ResponseStore(2)
    previous = None
    for name in ("a", "b", "c"):
        previous = Stored({"id": name}, [{"turn": name}], previous)
        store.put(previous)
    assert store.get("a") is None and store.get("b") is not None  # "a" went first; reading "b" makes it newest
    assert store.get("c").conversation() == [{"turn": "a"}, {"turn": "b"}, {"turn": "c"}]  # "a" evicted, still there
    store.put(Stored({"id": "d"}, []))
    assert (store.get("b"), len(store)) == (None, 2) and store.delete("c") and not store.delete("c")
    none = ResponseStore(0)
    none.put(Stored({"id": "a"}, []))
    assert len(none) == 0
