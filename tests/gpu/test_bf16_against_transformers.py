"""bfloat16 engine against transformers on the same random weights (device tool; skipped without a
GPU): greedy outputs may part where rounding flips a near tie, and where they first part, each
side's token must be in the other's top 5."""
from __future__ import annotations

import pytest
import torch

from bench.gpu import build_hf_model
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW_TOKENS = 32


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "qwen2.5-0.5b"])
def test_bf16_first_difference_is_a_top5_swap(shape: str) -> None:
    engine = LLMEngine(EngineConfig(model=f"random:{shape}", device="cuda", dtype="bfloat16", kv_cache_memory="2GiB"))
    hf = build_hf_model(shape, torch.bfloat16, torch.device("cuda"), engine.config.weights_seed)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, engine.model_config.vocab_size, (n,), generator=gen).tolist() for n in (5, 130, 1030)]
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True))
    identical = 0
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=NEW_TOKENS,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        theirs = out.sequences[0, len(prompt):].tolist()
        ours = result.token_ids
        assert len(ours) == NEW_TOKENS
        if ours == theirs:
            identical += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        our_top5 = [t for t, _ in result.samples[0].logprobs[i].top]
        their_top5 = out.scores[i][0].float().topk(5).indices.tolist()
        assert theirs[i] in our_top5 and ours[i] in their_top5, (i, ours[i], theirs[i], our_top5, their_top5)
    print(f"\n[{shape}] {identical}/{len(prompts)} greedy outputs identical to transformers' over {NEW_TOKENS} tokens")
