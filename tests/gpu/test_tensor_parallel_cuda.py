"""Tensor parallelism over two GPUs (device tool, kind nvidia-h200-x2; skipped with fewer GPUs): the
NCCL path with CUDA graphs gives one GPU's tokens. In float32 they must be identical; in bfloat16
the row-parallel sums round in another order, so where greedy outputs first part, each side's token
must be in the other's top 5."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import Completion, LLMEngine
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

NEW_TOKENS = 32


def _generate(size: int, dtype: str, prompts: list[list[int]]) -> tuple[list[Completion], int]:
    engine = LLMEngine(EngineConfig(model="random:llama-3.2-1b", device="cuda", dtype=dtype, kv_cache_memory="2GiB",
                                    max_num_seqs=8, tensor_parallel_size=size))
    try:
        assert sorted(engine.runner.graphs) == [1, 2, 3, 4, 5, 6, 7, 8]  # decode steps replay graphs with NCCL inside
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
        return engine.generate(prompts, params), engine.block_manager.num_blocks
    finally:
        engine.close()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128256, (n,), generator=gen).tolist() for n in (5, 130, 1030, 40)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpus_give_one_gpus_tokens(dtype: str) -> None:
    prompts = _prompts()
    one, blocks_one = _generate(1, dtype, prompts)
    two, blocks_two = _generate(2, dtype, prompts)
    assert blocks_two == 2 * blocks_one  # each GPU holds half the KV heads: twice the blocks in the same memory
    identical = 0
    for a, b in zip(one, two):
        assert len(b.token_ids) == NEW_TOKENS
        if a.token_ids == b.token_ids:
            identical += 1
            continue
        assert dtype == "bfloat16", (a.token_ids, b.token_ids)
        i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        top_a = [t for t, _ in a.samples[0].logprobs[i].top]
        top_b = [t for t, _ in b.samples[0].logprobs[i].top]
        assert a.token_ids[i] in top_b and b.token_ids[i] in top_a, (i, top_a, top_b)
    print(f"\n[{dtype}] {identical}/{len(prompts)} greedy outputs of two GPUs identical to one GPU's over {NEW_TOKENS} tokens")
