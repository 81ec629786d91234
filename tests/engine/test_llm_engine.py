"""The engine on the real embedded model (SmolLM2-135M-Instruct, float32) against transformers."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ContextLengthError, InvalidRequestError
from engine.llm_engine import Completion, LLMEngine
from engine.sampling_params import SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea and the wind, please, in English."}],
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List three prime numbers and explain in detail why each one of them is prime."},
    ],
    [{"role": "user", "content": "Translate to French: the cat sleeps on the warm windowsill all afternoon."}],
]
GREEDY = SamplingParams(temperature=0, max_tokens=32)
BLOCK_BYTES = 16 * 2 * 30 * 3 * 64 * 4  # one 16-token block of SmolLM2's KV in float32


@pytest.fixture(scope="module")
def reference(hf_default) -> list[list[int]]:
    """transformers generate(do_sample=False), 32 new tokens (or up to EOS), one chat at a time."""
    model, tokenizer = hf_default
    outputs = []
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=32)
        tokens = out[0, ids.shape[1]:].tolist()
        eos = tokenizer.eos_token_id
        outputs.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return outputs


def make_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **kw))


def check_text(engine: LLMEngine, result: Completion) -> None:
    """The streamed text deltas, joined, equal decoding all the tokens at once."""
    for sample in result.samples.values():
        assert sample.text == engine.tokenizer.decode(sample.token_ids)


def test_mixed_batch_matches_transformers(default_model_dir, reference) -> None:
    engine = make_engine(default_model_dir)
    results = engine.generate(CHATS, GREEDY)
    assert [r.token_ids for r in results] == reference
    lengths = {len(engine.tokenizer.apply_chat_template(c)) for c in CHATS}
    assert len(lengths) == len(CHATS)  # really a batch of different prompt lengths
    for r in results:
        check_text(engine, r)
    assert engine.block_manager.num_used_blocks == 0


def test_chunked_prefill_matches_transformers(default_model_dir, reference) -> None:
    engine = make_engine(default_model_dir, max_num_batched_tokens=16)
    chunks = []
    original = engine.runner.prepare
    engine.runner.prepare = lambda out, prev_rows: chunks.append(out.num_batched_tokens) or original(out, prev_rows)
    results = engine.generate(CHATS, GREEDY)
    assert [r.token_ids for r in results] == reference
    assert max(chunks) <= 16 and len(chunks) > 32  # every prompt (30+ tokens) took several steps


def test_preemption_keeps_outputs(default_model_dir, reference) -> None:
    engine = make_engine(default_model_dir, kv_cache_memory=14 * BLOCK_BYTES)
    results = engine.generate(CHATS, GREEDY)
    assert engine.stats().preemptions > 0
    assert [r.token_ids for r in results] == reference
    assert engine.block_manager.num_used_blocks == 0


def test_prefix_cache_computes_only_new_tokens(default_model_dir) -> None:
    engine = make_engine(default_model_dir)
    prefix = engine.tokenizer.encode("The history of the city, told slowly. " * 40)[:200]
    first, second = prefix + engine.tokenizer.encode(" Summary:"), prefix + engine.tokenizer.encode(" In short,")
    params = SamplingParams(temperature=0, max_tokens=8)
    engine.generate([first], params)
    before = engine.stats()
    [cached] = engine.generate([second], params)
    after = engine.stats()
    hit = 200 // 16 * 16  # full blocks of the shared prefix
    assert after.prefix_cache_hits - before.prefix_cache_hits == hit
    assert after.computed_prompt_tokens - before.computed_prompt_tokens == len(second) - hit
    assert after.prompt_tokens - before.prompt_tokens == len(second)
    assert cached.usage.cached_tokens == hit
    [uncached] = make_engine(default_model_dir, enable_prefix_caching=False).generate([second], params)
    assert cached.token_ids == uncached.token_ids


def test_n_samples_share_prompt_blocks_and_seeds_are_batch_independent(default_model_dir) -> None:
    engine = make_engine(default_model_dir)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, n=3, ignore_eos=True)
    request = engine.add_request(CHATS[1], params)
    engine.step()  # prefill + fork: all three samples hold the prompt's blocks
    prompt_blocks = len(request.prompt_token_ids) // 16
    tables = [s.block_table[:prompt_blocks] for s in request.sequences]
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2]
    while engine.has_unfinished():
        engine.step()
    alone = [s.output_token_ids for s in request.sequences]
    assert len({tuple(t) for t in alone}) == 3  # different samples
    others = [SamplingParams(temperature=0.8, max_tokens=12, top_k=20), SamplingParams(temperature=0, max_tokens=5)]
    mixed = engine.generate([CHATS[0], CHATS[1], CHATS[3]] + CHATS[2:4] * 3, [others[0], params] + others * 3 + others[:1])
    assert [mixed[1].samples[i].token_ids for i in range(3)] == alone


def test_stop_strings_never_appear(default_model_dir, reference) -> None:
    engine = make_engine(default_model_dir)
    full = engine.tokenizer.decode(reference[0])  # "The capital of France is Paris..."
    [r] = engine.generate([CHATS[0]], SamplingParams(temperature=0, max_tokens=32, stop=["Paris", "xyz"]))
    assert r.text == full[: full.index("Paris")]
    assert r.samples[0].finish_reason == "stop"
    [r] = engine.generate([CHATS[0]], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[reference[0][3]]))
    assert r.token_ids == reference[0][:4] and r.samples[0].finish_reason == "stop"


def test_bad_input_raises_typed_errors_and_engine_keeps_serving(default_model_dir, reference) -> None:
    engine = make_engine(default_model_dir, max_model_len=256)
    with pytest.raises(ContextLengthError):
        engine.add_request("word " * 300, SamplingParams())
    with pytest.raises(ContextLengthError):
        engine.add_request(CHATS[0], SamplingParams(max_tokens=250))
    for bad, param in [(dict(max_tokens=0), "max_tokens"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                       (dict(temperature=-1), "temperature"), (dict(logprobs=21), "top_logprobs"),
                       (dict(logit_bias={10**9: 1.0}), "logit_bias"), (dict(n=0), "n"), (dict(n=129), "n")]:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request(CHATS[0], SamplingParams(**bad))
        assert e.value.param == param
    for prompt in ([], [-1], [10**9], 3.5):
        with pytest.raises(InvalidRequestError):
            engine.add_request(prompt, SamplingParams())
    assert not engine.has_unfinished()
    assert [r.token_ids for r in engine.generate(CHATS[:2], GREEDY)] == reference[:2]


def test_abort_mid_generation_returns_every_block(default_model_dir) -> None:
    engine = make_engine(default_model_dir)
    keep = engine.add_request(CHATS[0], SamplingParams(temperature=0, max_tokens=32))
    gone = engine.add_request(CHATS[1], SamplingParams(max_tokens=100, n=2, ignore_eos=True))
    for _ in range(5):
        engine.step()
    used = engine.block_manager.num_used_blocks
    out = engine.abort(gone.request_id)
    assert out.finished and {d.finish_reason for d in out.deltas} == {"abort"}
    assert engine.block_manager.num_used_blocks < used
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    assert keep.sequences[0].finish_reason in ("stop", "length")


def test_finishes_on_length_and_context(default_model_dir) -> None:
    engine = make_engine(default_model_dir, max_model_len=64)
    prompt = engine.tokenizer.apply_chat_template(CHATS[3])
    [r] = engine.generate([prompt], SamplingParams(temperature=0, ignore_eos=True))
    assert r.samples[0].finish_reason == "length" and len(prompt) + len(r.token_ids) == 64
    [r] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(r.token_ids) == 3 and r.usage.completion_tokens == 3 and r.usage.prompt_tokens == len(prompt)


def test_logprobs_come_from_the_raw_distribution(default_model_dir, hf_default) -> None:
    engine = make_engine(default_model_dir)
    [r] = engine.generate([CHATS[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=5))
    model, tokenizer = hf_default
    ids = engine.tokenizer.apply_chat_template(CHATS[0])
    with torch.no_grad():
        logits = model(torch.tensor([ids + r.token_ids[:-1]])).logits[0, len(ids) - 1:].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(r.samples[0].logprobs):
        assert lp.token_id == r.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[i].topk(5).indices.tolist()


def test_steps_overlap_and_outputs_lag_one_step(default_model_dir, reference) -> None:
    engine = make_engine(default_model_dir)
    request = engine.add_request(CHATS[0], SamplingParams(temperature=0, max_tokens=3))
    seq = request.sequences[0]
    assert engine.step() == []  # the prefill is launched; its token is read in the next step
    assert seq.num_placeholders == 1 and seq.token_ids[-1] < 0
    counts = []
    while engine.has_unfinished():
        outs = engine.step()
        counts.append(sum(len(d.token_ids) for o in outs for d in o.deltas))
        assert all(t >= 0 for t in seq.token_ids[: seq.num_real_tokens])
    assert counts == [1, 1, 1]
    # The third token was decoded once more before the engine saw it end the request: that token is dropped.
    assert seq.output_token_ids == reference[0][:3] and seq.num_placeholders == 0
    assert engine.block_manager.num_used_blocks == 0


def test_penalties_read_real_history(default_model_dir, hf_default) -> None:
    """Penalties need the last token on the host, so such steps do not overlap; the tokens match a
    greedy loop over transformers' logits with the frequency penalty applied by hand."""
    engine = make_engine(default_model_dir)
    [r] = engine.generate([CHATS[1]], SamplingParams(temperature=0, max_tokens=8, frequency_penalty=1.5, ignore_eos=True))
    model, _ = hf_default
    ids = engine.tokenizer.apply_chat_template(CHATS[1])
    expected: list[int] = []
    with torch.no_grad():
        for _ in range(8):
            logits = model(torch.tensor([ids + expected])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(expected, dtype=torch.int64), minlength=logits.numel())
            expected.append(int((logits - 1.5 * counts).argmax()))
    assert r.token_ids == expected
    assert len(set(expected)) > 4  # the penalty really steers away from repeats


def test_a_random_model_takes_a_tokenizer_from_elsewhere(default_model_dir) -> None:
    engine = LLMEngine(EngineConfig(model="random:smollm2-135m", tokenizer=str(default_model_dir), device="cpu",
                                    kv_cache_memory="64MiB"))
    [r] = engine.generate([CHATS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(r.token_ids) == 5 and r.text == engine.tokenizer.decode(r.token_ids)
    small = LLMEngine(EngineConfig(model="random:tiny-llama3", tokenizer=str(default_model_dir), device="cpu",
                                   kv_cache_memory="16MiB"))  # a tokenizer larger than the embedding serves...
    assert small.sample_vocab_size == small.model_config.vocab_size == 512
    with pytest.raises(InvalidRequestError, match=r"\[0, 512\)"):  # ...but refuses prompts past the embedding
        small.make_request("The capital of France", SamplingParams(max_tokens=1))
    [r] = small.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
    assert len(r.token_ids) == 8 and max(r.token_ids) < 512
    small.close()


def test_ids_past_the_tokenizer_are_never_sampled(default_model_dir, tiny_model_dir) -> None:
    # A tiny random model (the limit is the sampler's, whatever the model) with the tokenizer's vocabulary.
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("tiny-llama3", vocab_size=49152)[0]),
                                    tokenizer=str(default_model_dir), device="cpu", kv_cache_memory="16MiB"))
    # Its vocabulary is the tokenizer's (49152): shrink what the sampler sees to test the limit.
    engine.runner.sampler.vocab_size = engine.sample_vocab_size = 1000
    [r] = engine.generate([[5, 6, 7]], SamplingParams(temperature=2.0, max_tokens=64, seed=1, ignore_eos=True, logprobs=3))
    assert max(r.token_ids) < 1000 and all(t < 1000 for lp in r.samples[0].logprobs for t, _ in lp.top)
    with pytest.raises(InvalidRequestError):
        engine.add_request([5], SamplingParams(logit_bias={1500: 1.0}))


def test_abort_during_the_final_step(tiny_model_dir) -> None:
    """As vLLM's test_abort_final_step: a request aborted while the step sampling its last token is
    in flight finishes as abort, its blocks are back at once, and that last token never comes out."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("tiny-llama3")[0]), kv_cache_memory="8MiB"))
    request = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.step() == []  # the prefill samples the first token
    [first] = engine.step()  # the last token's step is launched; the first token is read
    assert [(len(d.token_ids), d.finish_reason) for d in first.deltas] == [(1, None)]
    aborted = engine.abort(request.request_id)
    assert aborted.finished and [d.finish_reason for d in aborted.deltas] == ["abort"]
    assert aborted.usage.completion_tokens == 1
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()
    assert engine.step() == []  # the step in flight lands: its token for the aborted request is dropped
    assert request.sequences[0].finish_reason == "abort" and engine.block_manager.num_used_blocks == 0


def test_limits_are_checked_before_tokenizing(default_model_dir, monkeypatch) -> None:
    engine = make_engine(default_model_dir, max_model_len=256, max_num_seqs=4)
    # No token covers more characters than the longest vocabulary entry (81 for SmolLM2: a newline and 80 spaces).
    assert engine.max_prompt_chars == 256 * max(map(len, engine.tokenizer.hf.get_vocab()))
    tokenized = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, *a: tokenized.append(text) or [1] * 300)
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", lambda chat: tokenized.append(chat) or [1] * 300)
    huge = "x" * (engine.max_prompt_chars + 1)
    for prompt, param in ((huge, "prompt"), ([{"role": "user", "content": [{"type": "text", "text": huge}]}], "messages")):
        with pytest.raises(ContextLengthError) as e:
            engine.make_request(prompt, SamplingParams())
        assert e.value.param == param and "characters" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request("hi", SamplingParams(n=5))  # more samples than run side by side
    assert e.value.param == "n" and "--max-num-seqs" in e.value.message
    assert tokenized == []
    # An assistant turn is not counted (a template may drop parts of it): the token count decides.
    with pytest.raises(ContextLengthError):
        engine.make_request([{"role": "user", "content": "hi"}, {"role": "assistant", "content": huge}], SamplingParams())
    assert len(tokenized) == 1
