"""The official openai client against a real server: what existing apps do, changing only base_url."""
from __future__ import annotations

import asyncio

import openai
import pytest

from tests.app.conftest import MODEL_NAME

CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(client) -> None:
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_streamed_text_equals_non_streamed(client) -> None:
    full = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] == full.choices[0].finish_reason


def test_completions_n2_stop_and_echo(client) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=12,
                                    temperature=0.8, n=2, seed=3)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens <= 24 and all(c.text for c in out.choices)
    greedy = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = greedy.choices[0].text
    assert " 6" in text
    stopped = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                        stop=[" 6"])
    assert stopped.choices[0].text == text[: text.index(" 6")] and stopped.choices[0].finish_reason == "stop"
    echoed = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("1, 2, 3, 4,")
    batch = client.completions.create(model=MODEL_NAME, prompt=["Hello", "World"], max_tokens=2, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    ids = client.completions.create(model=MODEL_NAME, prompt=[[504, 3575], [19556]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 3


def test_seed_reproducibility(client) -> None:
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=1.0, seed=42)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    c = client.chat.completions.create(**{**kwargs, "seed": 43}).choices[0].message.content
    assert a == b and a != c


def test_logprobs(client) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the top token
    comp = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    assert len(comp.choices[0].logprobs.tokens) == 4 and len(comp.choices[0].logprobs.top_logprobs[0]) == 2
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"


def test_errors_are_the_sdks_exception_types(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x " * 9000}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, stream=True, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT,
                                       tools=[{"type": "retrieval", "function": {"name": "f", "parameters": {}}}])
    assert e.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)


def test_auth_and_rate_limit_errors(keyed_server) -> None:
    base = keyed_server.url + "/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    for key in ("key-one", "key-two"):
        assert openai.OpenAI(base_url=base, api_key=key, max_retries=0).models.list().data[0].id == MODEL_NAME
    with pytest.raises(openai.RateLimitError) as e:
        openai.OpenAI(base_url=base, api_key="key-one", max_retries=0).chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=2)
    assert e.value.response.headers["retry-after"] == "1"


def test_async_client_streams_concurrently(async_client) -> None:
    async def one(i: int) -> tuple[str, str]:
        kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=10,
                      temperature=0)
        full = await async_client.chat.completions.create(**kwargs)
        stream = await async_client.chat.completions.create(**kwargs, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return full.choices[0].message.content, text

    async def main() -> list[tuple[str, str]]:
        return await asyncio.gather(*(one(i) for i in range(4)))

    for full, streamed in asyncio.run(main()):
        assert full == streamed and full
