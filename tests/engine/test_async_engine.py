"""The engine's loop thread: concurrent requests, early exits, errors before the first output."""
from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import ContextLengthError, EngineDeadError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


@pytest.fixture
def engine(tiny_model_dir):
    path, _ = tiny_model_dir("tiny-llama3")
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(path), kv_cache_memory="8MiB"))).start()
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(prompt, params):
        for delta in out.deltas:
            tokens += delta.token_ids
    return tokens


def test_concurrent_requests_match_offline_results(engine: AsyncEngine) -> None:
    prompts = [[3 + i, 40 + i, 7, 9 * i + 1] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(collect(engine, p, params) for p in prompts))

    streamed = asyncio.run(run())
    offline = LLMEngine(engine.engine.config).generate(prompts, params)
    assert streamed == [r.token_ids for r in offline]
    assert engine.stats().kv_blocks_used == 0 and engine.stats().generation_tokens == 12 * 16


def test_leaving_early_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    async def run() -> None:
        async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True)):
            if sum(len(d.token_ids) for d in out.deltas):
                break  # the client went away after its first token
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not engine.engine.has_unfinished():
                break

    asyncio.run(run())
    assert not engine.engine.has_unfinished()
    assert engine.engine.block_manager.num_used_blocks == 0


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


def test_a_dead_loop_fails_waiters_and_new_requests(engine: AsyncEngine) -> None:
    def broken_step():
        raise RuntimeError("device lost")

    engine.engine.step = broken_step

    async def run() -> None:
        async for _ in engine.generate([5, 6], SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(run())
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(run())


def test_a_reader_that_falls_behind_gets_merged_outputs(engine: AsyncEngine) -> None:
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
    offline = LLMEngine(engine.engine.config).generate([[5, 6, 7]], params)[0]
    assert tokens == {i: offline.samples[i].token_ids for i in (0, 1)}
    assert logprobs == {0: 40, 1: 40}
    assert outputs < 20  # far fewer messages than the 40 steps
