"""Prompt logprobs (completions' echo with logprobs) against transformers on the embedded model."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."


@pytest.fixture(scope="module")
def reference(hf_default, default_model_dir) -> tuple[list[int], torch.Tensor]:
    model, tokenizer = hf_default
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunked-prefill"])
def test_prompt_logprobs_match_transformers(default_model_dir, reference, chunk: int | None) -> None:
    ids, ref = reference
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), device="cpu", **kw))
    assert len(ids) > 2 * (chunk or 0)
    engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2))  # its blocks are now cached...
    [r] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2))
    assert engine.tokenizer.encode(PROMPT) == ids
    lps = r.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None  # ...yet every position is computed
    for i, lp in enumerate(lps[1:], start=1):
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[i - 1].topk(3).indices.tolist()
    assert len(r.samples) == 2 and all(len(s.token_ids) == 2 for s in r.samples.values())
    assert engine.block_manager.num_used_blocks == 0


def test_no_prompt_logprobs_unless_asked(default_model_dir) -> None:
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), device="cpu"))
    [r] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=2))
    assert r.prompt_logprobs is None and len(r.samples[0].logprobs) == 1
