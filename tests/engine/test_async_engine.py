"""The engine's loop thread: concurrent requests, early exits, errors before the first output; and
the door the app uses for the model and its tokenizer."""
from __future__ import annotations

import asyncio
import shutil

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import ContextLengthError, EngineDeadError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


@pytest.fixture
def llm(tiny_model_dir) -> LLMEngine:
    path, _ = tiny_model_dir("tiny-llama3")
    return LLMEngine(EngineConfig(model=str(path), kv_cache_memory="8MiB"))


@pytest.fixture
def engine(llm: LLMEngine):
    engine = AsyncEngine(llm).start()
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(prompt, params):
        for delta in out.deltas:
            tokens += delta.token_ids
    return tokens


def test_concurrent_requests_match_offline_results(engine: AsyncEngine, llm: LLMEngine) -> None:
    prompts = [[3 + i, 40 + i, 7, 9 * i + 1] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(collect(engine, p, params) for p in prompts))

    streamed = asyncio.run(run())
    offline = LLMEngine(llm.config).generate(prompts, params)
    assert streamed == [r.token_ids for r in offline]
    assert engine.stats().kv_blocks_used == 0 and engine.stats().generation_tokens == 12 * 16


def test_leaving_early_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    def idle() -> bool:
        stats = engine.stats()
        return stats.running == stats.waiting == stats.kv_blocks_used == 0

    async def run() -> None:
        async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True)):
            if sum(len(d.token_ids) for d in out.deltas):
                assert engine.num_waiting == 0  # it runs: nothing waits
                break  # the client went away after its first token
        for _ in range(100):
            await asyncio.sleep(0.01)
            if idle():
                break

    asyncio.run(run())
    assert idle() and engine.num_waiting == 0


def test_bad_input_raises_before_the_first_output(engine: AsyncEngine) -> None:
    async def first(prompt, params):
        async for out in engine.generate(prompt, params):
            return out

    with pytest.raises(ContextLengthError):
        asyncio.run(first([5] * 2000, SamplingParams()))
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(first([5, 6], SamplingParams(top_p=2.0)))
    assert e.value.param == "top_p"
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        asyncio.run(first("text needs a tokenizer", SamplingParams()))
    assert asyncio.run(first([5, 6], SamplingParams(max_tokens=1))).finished
    assert engine.is_alive


def test_a_dead_loop_fails_waiters_and_new_requests(engine: AsyncEngine, llm: LLMEngine) -> None:
    def broken_step():
        raise RuntimeError("device lost")

    llm.step = broken_step

    async def run() -> None:
        async for _ in engine.generate([5, 6], SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(run())
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(run())


def test_a_reader_that_falls_behind_gets_merged_outputs(engine: AsyncEngine, llm: LLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1, n=2)

    async def run() -> tuple[int, dict[int, list[int]], dict[int, int]]:
        outputs, tokens, logprobs = 0, {0: [], 1: []}, {0: 0, 1: 0}
        async for out in engine.generate([5, 6, 7], params):
            outputs += 1
            for d in out.deltas:
                tokens[d.index] += d.token_ids
                logprobs[d.index] += len(d.logprobs or [])
            await asyncio.sleep(0.05)  # a slow client: several steps queue up meanwhile
        return outputs, tokens, logprobs

    outputs, tokens, logprobs = asyncio.run(run())
    offline = LLMEngine(llm.config).generate([[5, 6, 7]], params)[0]
    assert tokens == {i: offline.samples[i].token_ids for i in (0, 1)}
    assert logprobs == {0: 40, 1: 40}
    assert outputs < 20  # far fewer messages than the 40 steps


def test_the_model_without_a_tokenizer(engine: AsyncEngine, llm: LLMEngine) -> None:
    assert engine.max_model_len == llm.max_model_len and engine.vocab_size == llm.model_config.vocab_size
    assert not engine.has_tokenizer
    assert engine.token_text(7) == "7"
    for call in (lambda: engine.tokenize("hi"), lambda: engine.decode([5]),
                 lambda: engine.render_chat([{"role": "user", "content": "hi"}])):
        with pytest.raises(InvalidRequestError, match="no tokenizer") as e:
            call()
        assert e.value.param == "model"


def test_the_tokenizer_through_the_door(tiny_model_dir, default_model_dir, tmp_path) -> None:
    """A tiny model with the default model's tokenizer: the door tokenizes, renders chats and decodes
    exactly as the engine does for its prompts."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("tiny-llama3", vocab_size=49152)[0], path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, path)
    llm = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="8MiB"))
    engine = AsyncEngine(llm)  # not started: the door's model questions need no loop
    messages = [{"role": "user", "content": "Hello there"}]
    assert engine.has_tokenizer and llm.has_chat_template
    assert engine.tokenize("Hello there") == llm.make_request("Hello there", SamplingParams()).prompt_token_ids
    assert engine.render_chat(messages) == llm.make_request(messages, SamplingParams()).prompt_token_ids
    chat = engine.render_chat(messages)
    assert "<|im_start|>" in engine.decode(chat, skip_special_tokens=False)
    assert "<|im_start|>" not in engine.decode(chat) and "Hello there" in engine.decode(chat)
    assert "".join(engine.token_text(t) for t in chat) == engine.decode(chat, skip_special_tokens=False)
    assert engine.vocab_size == 49152
