"""Structured output and tool calls through the official openai SDK against a real server: the
embedded SmolLM2 (generic tool format, tools described in the system prompt) and a random-weight
model with the same tokenizer, whose every valid call the grammar alone makes valid."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.app.conftest import MODEL_NAME

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                   "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    "score": {"type": "number"},
    "nickname": {"type": "string", "maxLength": 10}},
    "required": ["name", "age", "address", "tags", "score"]}
LISTING = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 3,
              "items": {"type": "object", "properties": {"sku": {"type": "integer"}, "ok": {"type": "boolean"}},
                        "required": ["sku", "ok"]}},
    "kind": {"enum": ["x", "y"]}}, "required": ["items", "kind"]}
ITEM = LISTING["properties"]["items"]["items"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def random_client(random_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=random_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    city: Literal["Paris", "London", "Rome"]


def check_calls(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_parse_returns_the_pydantic_instance(client) -> None:
    done = client.chat.completions.parse(model=MODEL_NAME, response_format=Person, max_tokens=60, temperature=0,
                                         messages=[{"role": "user", "content": "Invent a person."}])
    assert isinstance(done.choices[0].message.parsed, Person)


@pytest.mark.parametrize("schema", [PERSON, LISTING])
def test_json_schema_outputs_validate(client, schema) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    done = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Fill it in."}],
                                          response_format=fmt, max_tokens=120, temperature=1.0, seed=5)
    for choice in done.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_vllm_extras(client) -> None:
    done = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Reply with the JSON object {\"ok\": true}."}],
                                          response_format={"type": "json_object"}, max_tokens=100, temperature=0)
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].message.content), dict)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=10,
                                          extra_body={"guided_choice": ["sunny", "rainy"]})
    assert chat.choices[0].message.content in ("sunny", "rainy")
    text = client.completions.create(model=MODEL_NAME, prompt="The code is", max_tokens=12,
                                     extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert text.choices[0].text[:3].isupper() and text.choices[0].text[3] == "-" and len(text.choices[0].text) == 6
    text = client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=12,
                                     extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert text.choices[0].text in ("yes", "no") and text.choices[0].finish_reason == "stop"


def test_required_and_named_tool_calls(client) -> None:
    # Each streamed and not: the streamed calls join to the non-streamed ones.
    for choice, allowed in (("required", {"get_weather", "get_time"}),
                            ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        whole = call(client, ASK, TOOLS, choice, parallel_tool_calls=False)
        streamed = call(client, ASK, TOOLS, choice, stream=True, parallel_tool_calls=False)
        for calls, reason, content in (whole, streamed):
            assert reason == "tool_calls" and not content
            assert len(calls) == 1
            check_calls(calls, allowed)
        assert [(c.function.name, c.function.arguments) for c in streamed[0]] == \
               [(c.function.name, c.function.arguments) for c in whole[0]]


def test_streamed_calls_join_to_the_non_streamed_ones(client) -> None:
    # Cut inside a call: 28 tokens end in the first one's arguments (whole calls: the test above).
    whole, reason, content = call(client, ASK, TOOLS, "required", max_tokens=28)
    streamed, streamed_reason, streamed_content = call(client, ASK, TOOLS, "required", stream=True, max_tokens=28)
    assert (reason, streamed_reason) == ("length", "length")
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
           [(c.function.name, c.function.arguments) for c in whole]
    assert whole and not content and not streamed_content  # a call cut short keeps what it got; no markup leaks


def test_tools_with_a_response_format_give_calls_or_the_json(client) -> None:
    # A one-object schema: the schema's own grammar is test_json_schema_outputs_validate's; here it
    # is the choice between it and the calls (the JSON under auto, calls under required).
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ITEM}}
    for choice, stream in (("auto", False), ("required", True)):
        calls, reason, content = call(client, [{"role": "user", "content": "List two items."}], TOOLS, choice,
                                      stream=stream, response_format=fmt, parallel_tool_calls=False)
        if calls or choice == "required":
            assert reason == "tool_calls" and not content
            check_calls(calls, {"get_weather", "get_time"})
        else:
            assert reason == "stop"
            jsonschema.validate(json.loads(content), ITEM)


def test_auto_answers_in_text_or_in_valid_calls(client) -> None:
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        for stream in (False, True):
            calls, reason, content = call(client, messages, TOOLS, "auto", stream=stream, max_tokens=60)
            if calls:
                assert reason == "tool_calls"
                check_calls(calls, {"get_weather", "get_time"})
            assert "<tool_call>" not in (content or "")


def test_agent_round_trip(client) -> None:
    calls, _, _ = call(client, ASK, [WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    history = ASK + [{"role": "assistant", "content": None,
                      "tool_calls": [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in calls]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21, "sky": "clear"}'} for c in calls]
    final = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=20, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_random_weights_under_required_make_only_valid_calls(random_client) -> None:
    counts = []
    for seed in range(6):  # streamed and not; among them calls cut short and parallel ones
        # Noise may go on calling until max_tokens cuts the last call short: the complete ones count.
        calls, reason, _ = call(random_client, ASK, TOOLS, "required", stream=seed % 2 == 1, temperature=1.5,
                                seed=seed, max_tokens=120)
        assert reason in ("tool_calls", "length"), reason
        complete = calls if reason == "tool_calls" else calls[:-1]  # a call cut short keeps what it got
        assert all(c.function.name in SCHEMAS for c in calls)
        if complete:
            check_calls(complete, {"get_weather", "get_time"})
        counts.append(len(calls))
    assert max(counts) > 1, counts  # parallel calls happen; every complete one is valid


def test_bad_inputs_are_400s_naming_the_param(client) -> None:
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=5, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
    assert client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=3).choices[0].message.content


def test_tokenize_takes_tools_and_continuation(server) -> None:
    base = {"messages": ASK + [{"role": "assistant", "content": "It is"}]}
    opened = httpx.post(server.url + "/tokenize", json=base).json()
    continued = httpx.post(server.url + "/tokenize", json=base | {"add_generation_prompt": False,
                                                                  "continue_final_message": True}).json()
    assert continued["count"] < opened["count"]
    with_tools = httpx.post(server.url + "/tokenize", json=base | {"tools": TOOLS}).json()
    assert with_tools["count"] >= opened["count"]


def test_metrics_count_constrained_requests(client, server) -> None:
    client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=5, extra_body={"guided_choice": ["a"]})
    text = httpx.get(server.url + "/metrics").text
    count = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("minillm_constrained_requests_total"))
    seconds = next(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("minillm_grammar_mask_seconds_total"))
    assert count >= 1 and seconds > 0


def call(client: openai.OpenAI, messages, tools, tool_choice, stream: bool = False, **kw):
    """(tool calls, finish reason, content) of one choice; a stream is joined as a client would."""
    kw = {"max_tokens": 120, "temperature": 0} | kw
    if not stream:
        done = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=tools,
                                              tool_choice=tool_choice, **kw)
        msg = done.choices[0].message
        return msg.tool_calls or [], done.choices[0].finish_reason, msg.content
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=tools,
                                                tool_choice=tool_choice, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id:  # the first delta of a call: index, id, type, name
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = openai.types.chat.ChatCompletionMessageToolCall(
                    id=d.id, type="function", function={"name": d.function.name, "arguments": d.function.arguments or ""})
            else:
                calls[d.index].function.arguments += d.function.arguments or ""
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    assert len(reasons) == 1  # finish_reason exactly once, on the last chunk
    return [calls[i] for i in sorted(calls)], reasons[0], content
