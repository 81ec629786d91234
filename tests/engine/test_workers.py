"""Tensor parallelism on CPU: two processes (gloo) serve the embedded model with the same tokens as
one; sizes that cannot work are refused before any process starts; a rank that dies ends rank 0
instead of leaving it waiting in a collective."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError, ModelLoadError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


def _config(model: Path, size: int) -> EngineConfig:
    # Small chunks: the long prompt is prefilled in several steps beside the others' decodes. The
    # session's conversion (not "default", which would convert it again in a fresh home directory).
    return EngineConfig(model=str(model), dtype="float32", tensor_parallel_size=size, kv_cache_memory="64MiB",
                        max_num_batched_tokens=32)


def _run(engine: LLMEngine) -> list[tuple[list[int], list[float]]]:
    greedy = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, logprobs=2)
    forked = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8, logprobs=2)  # copy-on-write blocks
    long = " ".join(PROMPTS * 6)  # about 100 tokens: chunked; asked twice, the second hits the prefix cache
    prompts = PROMPTS + [long, long, PROMPTS[0], PROMPTS[2]]
    params = [greedy] * 3 + [greedy, greedy, seeded, forked]
    done = engine.generate(prompts, params)
    return [(s.token_ids, [lp.logprob for lp in s.logprobs]) for c in done for _, s in sorted(c.samples.items())]


@pytest.mark.slow
def test_two_ranks_give_the_tokens_of_one(default_model_dir) -> None:
    one = LLMEngine(_config(default_model_dir, 1))
    expected = _run(one)
    two = LLMEngine(_config(default_model_dir, 2))
    try:
        assert two.tp.size == 2 and two.runner.kv_cache.shape[4] == 2  # rank 0 holds 2 of the 3 KV heads
        # Each rank holds fewer KV heads, so the same memory holds more blocks.
        assert two.block_manager.num_blocks == one.block_manager.num_blocks * 3 // 2
        got = _run(two)
    finally:
        two.close()
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3
    assert not multiprocessing.active_children()  # close() stopped the other rank
    assert not torch.distributed.is_initialized()  # and left the group with it


@pytest.mark.parametrize(("size", "error", "message"), [
    (4, ModelLoadError, "3 KV heads and 9 query heads cannot be split over 4 ranks"),
    (0, InvalidRequestError, "at least 1"),
])
def test_sizes_that_cannot_work_are_refused_first(default_model_dir, size, error, message) -> None:
    with pytest.raises(error, match=message):
        LLMEngine(_config(default_model_dir, size))
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_signals_to_the_process_group_leave_the_other_ranks_to_rank_0(tmp_path) -> None:
    """Ctrl-C reaches every process of a terminal's group: rank 0 drains, and the other ranks must
    still be serving until it stops them."""
    script = textwrap.dedent("""
        import multiprocessing, os, signal, time
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        from engine.sampling_params import SamplingParams
        if __name__ == "__main__":
            engine = LLMEngine(EngineConfig(model="random:tiny-llama3", tensor_parallel_size=2, kv_cache_memory="16MiB"))
            [worker] = multiprocessing.active_children()
            for sig in (signal.SIGINT, signal.SIGTERM):
                os.kill(worker.pid, sig)
            time.sleep(1)
            [out] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
            print(len(out.token_ids), worker.is_alive(), flush=True)
            engine.close()
            print(worker.exitcode, flush=True)
    """)
    (tmp_path / "signals.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(tmp_path / "signals.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["3 True", "0"], proc.stderr[-3000:]  # the ranks' logs say why


@pytest.mark.slow
def test_a_dead_rank_ends_rank_0(tmp_path) -> None:
    script = textwrap.dedent("""
        import multiprocessing, os, signal, time
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        from engine.sampling_params import SamplingParams
        if __name__ == "__main__":
            engine = LLMEngine(EngineConfig(model="random:tiny-llama3", tensor_parallel_size=2, kv_cache_memory="16MiB"))
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
            print("served", flush=True)
            [worker] = multiprocessing.active_children()
            os.kill(worker.pid, signal.SIGKILL)
            time.sleep(30)  # the watchdog ends this process long before
            print("still here", flush=True)
    """)
    (tmp_path / "dead_rank.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(tmp_path / "dead_rank.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.splitlines() == ["served"], proc.stderr[-3000:]
    assert proc.returncode == 1
    assert "tensor-parallel worker minillm-tp1 exited with code -9" in proc.stderr


def _tiny_awq(tiny_model_dir, tmp_path) -> str:
    from tests.engine.quantization.conftest import _float_and_awq_by_hand

    return str(_float_and_awq_by_hand(tiny_model_dir("tiny-llama3")[0], tmp_path)[1])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["random:tiny-qwen2", "awq", "fp8"])
def test_two_ranks_serve_biases_and_quantized_weights(tiny_model_dir, tmp_path, model) -> None:
    """Qwen2's QKV bias follows its column shards; AWQ and FP8 weights are cut in their own layouts."""
    path = _tiny_awq(tiny_model_dir, tmp_path) if model == "awq" else "random:tiny-llama3" if model == "fp8" else model
    quantization = "fp8" if model == "fp8" else None
    prompts = [[1, 5, 9, 200, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for size in (1, 2):
        engine = LLMEngine(EngineConfig(model=path, tensor_parallel_size=size, kv_cache_memory="16MiB",
                                        quantization=quantization))
        try:
            outputs.append([c.token_ids for c in engine.generate(prompts, params)])
        finally:
            engine.close()
    assert outputs[0] == outputs[1]
