"""The official openai client against a real server: what existing apps do, changing only base_url."""
from __future__ import annotations

import asyncio

import httpx
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


# ---- issue 28, item 10: what vLLM's own API tests found ----------------------------------------------


def test_completions_top_logprobs_always_hold_the_sampled_token(client) -> None:
    none = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0, logprobs=0)
    lp = none.choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]  # was [{}] each
    sampled = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=8, temperature=1.5, seed=1,
                                        logprobs=1, stream=True)
    for chunk in sampled:
        lp = chunk.choices[0].logprobs
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[token] == logprob and len(top) in (1, 2)


def test_completions_default_to_16_tokens_also_when_max_tokens_is_null(client) -> None:
    for body in ({}, {"max_tokens": None}):
        out = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", temperature=0,
                                        extra_body={"ignore_eos": True, **body})
        assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_an_empty_model_name_is_the_served_model(client, server) -> None:
    assert client.chat.completions.create(model="", messages=CHAT, max_tokens=1).model == MODEL_NAME
    assert client.completions.create(model="", prompt="Hi", max_tokens=1).model == MODEL_NAME
    assert httpx.post(server.url + "/tokenize", json={"model": "", "prompt": "Hi"}).status_code == 200


def test_seed_takes_openais_signed_64_bit_range(client) -> None:
    for seed in (2**63 - 1, -(2**63)):
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1, seed=seed)
    for seed in (2**63, 2**64 - 1, 2**64, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1, seed=seed)
        assert e.value.body["param"] == "seed" and "-9223372036854775808, 9223372036854775807" in e.value.body["message"]


ECHO_PROMPT = "The quick brown fox jumps over the lazy dog."


def check_legacy_logprobs(lp, text: str, num_top: int) -> None:
    """text_offset indexes each token in the choice's text; every top_logprobs holds its token."""
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert text[offset: offset + len(token)] == token
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == logprob and max(num_top, 1) <= len(top) <= num_top + 1


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, hf_default) -> None:
    import torch

    model, tokenizer = hf_default
    ids = tokenizer(ECHO_PROMPT)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    kwargs = dict(model=MODEL_NAME, prompt=ECHO_PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0)
    out = client.completions.create(**kwargs)
    [choice] = out.choices
    lp = choice.logprobs
    assert choice.text.startswith(ECHO_PROMPT) and len(lp.tokens) == len(ids) + out.usage.completion_tokens
    assert "".join(lp.tokens[: len(ids)]) == ECHO_PROMPT and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    expected = [ref[k - 1, ids[k]].item() for k in range(1, len(ids))]
    # float32 on both sides, but summed in other orders (the server batches other rows beside it)
    assert lp.token_logprobs[1: len(ids)] == pytest.approx(expected, rel=1e-3, abs=1e-3)
    for k in range(1, len(ids)):
        top2 = [tokenizer.decode([t]) for t in ref[k - 1].topk(2).indices.tolist()]
        assert set(top2) <= set(lp.top_logprobs[k])
    check_legacy_logprobs(lp, choice.text, 2)

    chunks = list(client.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].text.startswith(ECHO_PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = {key: [v for c in chunks for v in getattr(c.choices[0].logprobs, key)]
                for key in ("tokens", "text_offset", "token_logprobs", "top_logprobs")}
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"][0] is None and streamed["top_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    assert [sorted(top) for top in streamed["top_logprobs"][1:]] == [sorted(top) for top in lp.top_logprobs[1:]]
    assert len(chunks[0].choices[0].logprobs.tokens) > len(ids)  # the prompt's part came first, whole


def test_echo_with_logprobs_per_prompt_and_choice(client) -> None:
    prompts = [[504, 3575, 314], [19556, 28, 957, 1345]]  # token ids: echoed as their decoded text
    kwargs = dict(model=MODEL_NAME, prompt=prompts, echo=True, logprobs=0, n=2, max_tokens=2, temperature=1.0, seed=5)
    out = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    prompt_logprobs = []
    for c in out.choices:
        p = prompts[c.index // 2]
        lp = c.logprobs
        assert c.text.startswith("".join(lp.tokens[: len(p)])) and lp.token_logprobs[0] is None
        assert all(v < 0 for v in lp.token_logprobs[1: len(p)])
        check_legacy_logprobs(lp, c.text, 0)
        prompt_logprobs.append(lp.token_logprobs[: len(p)])
        first = next(ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index)
        assert first.logprobs.token_logprobs[: len(p)] == pytest.approx(lp.token_logprobs[: len(p)], abs=1e-4)
        assert first.text.startswith("".join(lp.tokens[: len(p)]))
    assert prompt_logprobs[0] == prompt_logprobs[1] and prompt_logprobs[2] == prompt_logprobs[3]  # each choice
    assert len(prompt_logprobs[0]) == 3 and len(prompt_logprobs[2]) == 4  # each prompt its own


def test_echo_with_max_tokens_0_returns_the_prompt_scored(client) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=ECHO_PROMPT, echo=True, logprobs=1, max_tokens=0)
    out = client.completions.create(**kwargs)
    [choice] = out.choices
    assert choice.text == ECHO_PROMPT and choice.finish_reason == "length"
    assert "".join(choice.logprobs.tokens) == ECHO_PROMPT and len(choice.logprobs.tokens) == out.usage.prompt_tokens
    assert out.usage.completion_tokens == 0 and out.usage.total_tokens == out.usage.prompt_tokens
    check_legacy_logprobs(choice.logprobs, choice.text, 1)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == ECHO_PROMPT and chunks[-1].usage.completion_tokens == 0
    assert [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens] == choice.logprobs.tokens
    with pytest.raises(openai.BadRequestError) as e:  # without echo there is nothing to return
        client.completions.create(model=MODEL_NAME, prompt=ECHO_PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
