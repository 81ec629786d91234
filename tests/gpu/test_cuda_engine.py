"""The same engine on a CUDA GPU (run through the device tool; skipped without a GPU)."""
from __future__ import annotations

import copy
import gc
import time

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import _InputRing
from kernels.staging import stage
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("shape", ["tiny-llama3", "tiny-mistral", "tiny-qwen2"])
def test_float32_greedy_matches_transformers_on_cuda(tiny_model_dir, shape: str) -> None:
    path, hf = tiny_model_dir(shape)
    hf = copy.deepcopy(hf).to("cuda")  # the fixture model is shared with the CPU tests
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", kv_cache_memory="64MiB"))
    gen = torch.Generator().manual_seed(2)
    # 9 prompts: their decode steps replay the 12-row graph, 3 rows of it padding.
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 33, 150, 3, 12, 20, 48, 64, 97)]
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=32,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert result.token_ids == ref


def test_seeded_sampling_is_the_same_on_cuda_and_cpu(tiny_model_dir) -> None:
    path, _ = tiny_model_dir("tiny-llama3")
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=7, ignore_eos=True)
    cpu = LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_memory="16MiB")).generate([[5, 6, 7]], params)
    gpu = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", kv_cache_memory="16MiB")).generate(
        [[5, 6, 7]], params)
    # Same weights and noise; float32 kernels differ slightly between devices, so compare a prefix.
    assert cpu[0].token_ids[:8] == gpu[0].token_ids[:8]


def test_llama_1b_shape_runs_in_bfloat16() -> None:
    engine = LLMEngine(EngineConfig(model="random:llama-3.2-1b", device="cuda", kv_cache_memory="4GiB"))
    prompts = [list(range(100 + i, 228 + i)) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert all(len(r.token_ids) == 64 for r in results)
    assert engine.block_manager.num_used_blocks == 0
    print(f"\n[eager torch reference path, not a benchmark] 8 x 64 tokens in {elapsed:.2f} s "
          f"= {8 * 64 / elapsed:.0f} tok/s")


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.8), dict(temperature=0.8, top_p=0.9)],
                         ids=["greedy", "seeded", "top-p"])
def test_cuda_graph_decode_matches_eager_steps(params: dict) -> None:
    """Graph replay gives exactly the eager steps' tokens (same batch shapes, so the same GEMMs), the
    graph drawing greedy and plain seeded rows itself and leaving filtered ones to the sampler.
    Padding rows are covered by the tiny models above: 9 prompts replay the 12-row graph."""
    prompts = [list(range(10 + 3 * i, 50 + 7 * i)) for i in range(8)]
    sampling = [SamplingParams(**params, seed=i, max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    config = dict(model="random:llama-3.2-1b", device="cuda", kv_cache_memory="2GiB", max_num_seqs=8)
    graphed = LLMEngine(EngineConfig(**config))
    assert sorted(graphed.runner.graphs) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert graphed.runner.input_ring is not None and graphed.runner.host_ring is not None  # mapped pinned memory
    graphed.runner.prefill_graphs.clear()  # the same prefill GEMMs as the eager engine's (their own test below)
    drawn, read = [], graphed.runner.sampler.drawn
    graphed.runner.sampler.drawn = lambda *args: (drawn.append(1), read(*args))[1]
    eager = LLMEngine(EngineConfig(**config, cuda_graphs=False))
    assert not eager.runner.graphs
    got = [r.token_ids for r in graphed.generate(prompts, sampling)]
    assert got == [r.token_ids for r in eager.generate(prompts, sampling)]
    assert bool(drawn) == ("top_p" not in params)
    assert graphed.runner.input_ring.taken > 0
    counted = int(graphed.runner.input_ring.counter)
    for _ in range(6):  # replayed alone, as bench/profile_step.py does: no input row is theirs, nothing counts
        graphed.runner.graphs[8].graph.replay()
    assert int(graphed.runner.input_ring.counter) == counted
    # Again beside the eager engine: both now hit the prefix cache, so their prefills are shorter
    # than the first run's (other GEMM shapes, so other bf16 tokens) but the same as each other's.
    again = [r.token_ids for r in graphed.generate(prompts, sampling)]
    assert again == [r.token_ids for r in eager.generate(prompts, sampling)]


def test_input_ring_feeds_kernels_queued_back_to_back() -> None:
    """The host queues steps ahead of a busy device: each stage reads its own step's row, and a row
    is rewritten only once read (put waits for the device when it would come round too soon)."""
    device = torch.device("cuda")
    ring, dst = _InputRing(64, device), torch.zeros(64, dtype=torch.int32, device=device)
    outs = []
    torch.cuda._sleep(200_000_000)  # about 0.1 s of device time ahead of the copies
    for step in range(3 * _InputRing.ROWS):
        ring.put(np.full(8, step, dtype=np.int32), 1)
        stage(ring.rows, ring.counter, ring.consumed, dst, 1)
        outs.append(dst[:8].clone())
    torch.cuda.synchronize()
    assert [o.tolist() for o in outs] == [[step] * 8 for step in range(3 * _InputRing.ROWS)]


def test_prefill_graphs_match_eager_steps() -> None:
    """Steps with prefill chunks replayed from the prefill graphs (tokens padded to the graph's
    count, padding sequences, chunks beside decodes, placeholders of the step before) give the
    eager steps' tokens and logprobs, in float32 (the padded GEMMs may sum in another order)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (5, 100, 300, 700, 64, 1)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    config = dict(model="random:llama-3.2-1b", device="cuda", dtype="float32", kv_cache_memory="2GiB",
                  max_num_seqs=8, max_num_batched_tokens=512)  # the 700-token prompt in two chunks
    graphed = LLMEngine(EngineConfig(**config))
    assert sorted(graphed.runner.prefill_graphs) == [16, 32, 64, 128, 256, 512]
    replays = []
    for graph in graphed.runner.prefill_graphs.values():
        graph.graph.replay = (lambda g: lambda: (replays.append(g.tokens), type(g.graph).replay(g.graph))[1])(graph)
    eager = LLMEngine(EngineConfig(**config, cuda_graphs=False))
    got, want = graphed.generate(prompts, params), eager.generate(prompts, params)
    assert 512 in replays and len(replays) >= 2  # the first chunk and the rest of the prompts
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for g, w in zip(got, want):
        logprobs = [[lp.logprob for lp in r.samples[0].logprobs] for r in (g, w)]
        torch.testing.assert_close(*logprobs, atol=1e-3, rtol=1e-3)
    assert graphed.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("method", ["ngram", "ngram-ahead", "draft"])
def test_speculation_keeps_the_outputs_on_cuda(method: str) -> None:
    """Verify steps replay the decode graphs, a row per token (and the draft model's one-token steps
    its own decode graphs, on the same GPU): greedy and seeded outputs are those without
    speculation, and no block is left held. float32, so the verify step's GEMMs (k + 1 rows a sequence) round as the one-row steps do;
    decode attention reads the drafts' keys only after the kernel that writes them. "ahead": every
    step goes ahead of the step with drafts in flight, its first rows placeholders for that step's
    samples, and is stale where they were rejected."""
    method, _, ahead = method.partition("-")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() * 3 for n in (5, 20, 60)]  # text that repeats
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    config = dict(model="random:tiny-llama3", device="cuda", dtype="float32", kv_cache_memory="64MiB")
    draft = "random:tiny-llama3-draft" if method == "draft" else None
    spec = LLMEngine(EngineConfig(**config, speculative_method=method, num_speculative_tokens=4,
                                  speculative_max_batch=4, speculative_gate=False,
                                  speculative_model=draft, speculative_overlap=bool(ahead)))
    if ahead:
        spec.scheduler.lookahead.record = lambda host, device: None
        spec.scheduler.lookahead.min_progress = 0.0
        spec.scheduler.lookahead.gate = None
    plain = LLMEngine(EngineConfig(**config))
    replays, draft_replays = [], []
    proposer = spec.scheduler.proposer
    for runner, log in [(spec.runner, replays)] + ([(proposer.runner, draft_replays)] if method == "draft" else []):
        for graph in runner.graphs.values():
            graph.graph.replay = (lambda g, log: lambda: (log.append(g.batch), type(g.graph).replay(g.graph))[1])(
                graph, log)
    got = [r.token_ids for r in spec.generate(prompts, params)]
    assert got == [r.token_ids for r in plain.generate(prompts, params)]
    # Going ahead of every step, the random model's drafts past a guess were all rejected on the H200.
    assert (spec.draft_tokens_total if ahead else spec.accepted_draft_tokens_total) > 0
    assert max(replays) > len(prompts)  # more rows than sequences: verify steps
    assert spec.block_manager.num_used_blocks == 0
    assert method != "draft" or (len(proposer.free_blocks) == proposer.num_blocks and draft_replays)


def test_kv_budget_comes_from_gpu_memory_utilization() -> None:
    gc.collect()  # the engines of the tests before (the budget counts every allocation of the process)
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    engine = LLMEngine(EngineConfig(model="random:qwen2.5-0.5b", device="cuda", gpu_memory_utilization=0.5,
                                    max_num_seqs=16))
    kv_bytes = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size()
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert weights + kv_bytes < 0.5 * total  # the activations' peak comes off the KV share too
    assert kv_bytes > 0.5 * total - weights - 4 * 2**30  # and not much more than that
    [r] = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(r.token_ids) == 4


@torch.inference_mode()
@pytest.mark.parametrize("shape", ["tiny-llama3", "tiny-qwen2"])
@pytest.mark.parametrize("fmt", ["bf16", "int4", "fp8"])
def test_batch1_decode_with_folded_norms_matches_the_unfolded_model(tiny_model_dir, tmp_path, shape: str,
                                                                    fmt: str) -> None:
    """One token through a bf16, int4 or FP8 model on the GPU (bfloat16): the norms folded into the one-row
    kernels (1 norm kernel instead of 2L) give the unfolded model's logits, within bf16 (a
    missing factor or residual would be off by O(1))."""
    from engine.loader import load_model
    from engine.packed_prefill import prompt_logits
    from engine.quantization import quantize_checkpoint
    from kernels.dispatch import unfolded_norms

    path, _ = tiny_model_dir(shape)
    if fmt == "bf16":
        model = load_model(path, torch.bfloat16, torch.device("cuda"))
    elif fmt == "int4":
        model = load_model(quantize_checkpoint(str(path), tmp_path / "q", "rtn", group_size=32, device="cuda"),
                           torch.bfloat16, torch.device("cuda"))
    else:
        model = load_model(path, torch.bfloat16, torch.device("cuda"), quantization="fp8")
    folded = prompt_logits(model, [7])
    with unfolded_norms():
        apart = prompt_logits(model, [7])
    rel = ((folded - apart).norm() / apart.norm()).item()
    assert rel < 2e-2, rel
    # Greedy picks the same token but for near-ties (FP8 tiny Qwen2 had one): within bf16 noise of the top.
    assert apart[0, folded.argmax()] >= apart.max() - 2e-2 * apart.abs().max()
