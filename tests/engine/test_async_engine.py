"""The engine's loop thread: concurrent requests, early exits, errors before the first output; and
the door the app uses for the model and its tokenizer."""
from __future__ import annotations

import asyncio
import shutil
import threading

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import ContextLengthError, EngineDeadError, EngineFailedError, InvalidRequestError
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


async def drain(outputs) -> list:
    return [out async for out in outputs]


def test_a_forward_error_fails_every_request_in_flight(engine: AsyncEngine, llm: LLMEngine) -> None:
    """As vLLM's test_forward_error: a forward that raises fails each request in flight with an
    internal error naming it, the engine is dead, and what comes after is refused as such."""
    real, calls = llm.runner.forward, []

    def forward(*args):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("device lost")
        return real(*args)

    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def run() -> None:
        late = engine.prepare([9, 9], params)  # prepared before the fault, queued after it
        llm.runner.forward = forward
        errors = await asyncio.gather(*(drain(engine.generate([5 + i, 6], params, f"req-{i}")) for i in range(3)),
                                      return_exceptions=True)
        for i, e in enumerate(errors):
            assert isinstance(e, EngineFailedError) and e.code == "engine_failed" and f"request req-{i} " in e.message
        assert not engine.is_alive
        with pytest.raises(EngineDeadError):
            engine.prepare([5, 6], params)
        with pytest.raises(EngineDeadError):  # not left waiting for a loop that is gone
            await asyncio.wait_for(drain(engine.stream(late)), 30)

    asyncio.run(run())


def test_finished_but_unread_streams_do_not_count_as_waiting(engine: AsyncEngine) -> None:
    async def run() -> None:
        unread = [engine.stream(engine.prepare([5, i], SamplingParams(max_tokens=8, ignore_eos=True)))
                  for i in range(3)]
        assert engine.num_waiting >= 1  # counted from the moment they are queued
        for outputs in unread:
            await anext(outputs)  # the clients read their first token, then stop reading
        for _ in range(1000):  # the engine finishes them anyway
            stats = engine.stats()
            if stats.generation_tokens == 24 and stats.running == stats.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.num_waiting == 0
        for outputs in unread:
            assert (await drain(outputs))[-1].finished

    asyncio.run(run())


def test_admission_counts_sequences_and_reserves_at_once(llm: LLMEngine) -> None:
    engine = AsyncEngine(llm)  # not started: what is queued stays queued

    async def run() -> None:
        assert engine.reserve(3, 4) and not engine.reserve(2, 4)  # the second sees the first at once
        outputs = engine.stream(llm.make_request([5, 6], SamplingParams(n=2)))
        engine.release(3)  # the call's reservation, now that its request is queued
        assert engine.num_waiting == 2  # a request of n=2 waits as two sequences
        assert engine.reserve(2, 4) and not engine.reserve(1, 4)
        engine.release(2)
        del outputs

    asyncio.run(run())
    llm.add_request([5, 6], SamplingParams(n=3))
    assert llm.stats().waiting == 3  # its samples to fork wait with it


def test_a_stream_dropped_unread_is_aborted(engine: AsyncEngine) -> None:
    async def run() -> None:
        outputs = engine.stream(engine.prepare([5, 6], SamplingParams(max_tokens=1000, ignore_eos=True)))
        await asyncio.sleep(0.05)
        del outputs  # the route failed before reading it
        for _ in range(1000):
            stats = engine.stats()
            if engine.num_waiting == stats.running == stats.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.num_waiting == engine.stats().running == 0
        assert engine.stats().generation_tokens < 1000  # aborted, not run to its end
        assert len(await drain(engine.generate([5, 6], SamplingParams(max_tokens=2)))) >= 1

    asyncio.run(run())


def test_a_caller_that_gives_up_frees_the_tokenizer_thread(engine: AsyncEngine, llm: LLMEngine,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    started, release, made = threading.Event(), threading.Event(), []
    real = llm.make_request

    def make_request(prompt, params, request_id=None):
        made.append(prompt[0])
        if prompt[0] == 100:  # a long tokenization, whose client gives up meanwhile
            started.set()
            release.wait(30)
        return real(prompt, params, request_id)

    monkeypatch.setattr(llm, "make_request", make_request)
    params = SamplingParams(max_tokens=1)

    async def run() -> None:
        busy = asyncio.ensure_future(engine.prepare_all([([100, 1], params, None), ([101, 1], params, None)]))
        await asyncio.to_thread(started.wait, 30)
        queued = asyncio.ensure_future(engine.prepare_all([([200, 1], params, None)]))
        for _ in range(3):
            await asyncio.sleep(0)  # queued is on the tokenizer thread's queue now
        busy.cancel()
        queued.cancel()
        await asyncio.gather(busy, queued, return_exceptions=True)
        for _ in range(3):
            await asyncio.sleep(0)  # the cancellations reach the tokenizer thread's queue
        release.set()
        [after] = await engine.prepare_all([([300, 1], params, None)])
        assert after.prompt_token_ids == [300, 1]

    asyncio.run(run())
    assert made == [100, 300]  # 101: the started call stopped between prompts; 200 never started


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
