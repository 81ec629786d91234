"""Our decoder against transformers on tiny random-weight models of each family, float32."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("shape", ["tiny-llama3", "tiny-mistral", "tiny-qwen2"])
def test_greedy_matches_transformers(tiny_model_dir, shape: str) -> None:
    path, hf = tiny_model_dir(shape)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_memory="32MiB"))
    gen = torch.Generator().manual_seed(1)
    # Lengths past tiny-llama3's original context (64) exercise llama3 rope scaling.
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 40, 130)]
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(hf, prompt, 32)
    assert engine.block_manager.num_used_blocks == 0


def test_qwen2_has_bias_and_untied_head(tiny_model_dir) -> None:
    path, hf = tiny_model_dir("tiny-qwen2")
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_memory="32MiB"))
    layer = engine.model.layers[0]
    assert layer.qkv_proj.bias is not None and layer.qkv_proj.bias.abs().sum() > 0
    assert engine.model.lm_head is not None
    assert not torch.equal(engine.model.lm_head.weight, engine.model.embed_tokens.weight)


def test_sharded_checkpoint_loads_the_same(tiny_model_dir, tmp_path) -> None:
    path, hf = tiny_model_dir("tiny-llama3")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    whole = LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_memory="16MiB"))
    sharded = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", kv_cache_memory="16MiB"))
    for a, b in zip(whole.model.state_dict().values(), sharded.model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(tiny_model_dir, dtype: str) -> None:
    path, hf = tiny_model_dir("tiny-llama3")
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype=dtype, kv_cache_memory="16MiB"))
    assert engine.runner.kv_cache.dtype == getattr(torch, dtype)
    [result] = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    # Half precision may flip a late near-tie, but the first greedy token is robust on this model.
    assert result.token_ids[0] == hf_greedy(hf, [5, 6, 7, 8], 1)[0]
    assert len(result.token_ids) == 8


def test_logits_come_in_the_models_dtype_when_asked(tiny_model_dir) -> None:
    """A decode graph takes the logits in the model's dtype (its draw reads them as float32): the
    same values as the float32 logits, cut to the vocabulary."""
    from engine.loader import load_model

    path, _ = tiny_model_dir("tiny-llama3")
    model = load_model(path, torch.bfloat16, torch.device("cpu"))
    hidden = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        native, float32 = model.compute_logits(hidden, dtype=None), model.compute_logits(hidden)
    assert native.dtype == torch.bfloat16 and float32.dtype == torch.float32
    assert native.shape == float32.shape == (3, model.cfg.vocab_size)
    assert torch.equal(native.float(), float32)


@pytest.mark.parametrize("shape", ["tiny-llama3", "tiny-qwen2"])
def test_decode_folds_the_norms_and_rope_into_the_float_projections(tiny_model_dir, triton_interpreter, monkeypatch,
                                                                    shape: str) -> None:
    """Up to FLOAT_FUSED_ROWS tokens (one for float32; FEW_ROWS when the few-row kernel takes them)
    through a float model on the Triton kernels run 1 norm kernel, not 2L, and no RoPE kernel (the
    first norm is always the embedding kernel's): the projections' epilogues and scaled outputs do
    the rest; one decode row's o_proj merges attention's splits too (no merge kernel). The logits are the unfolded path's and transformers'; more rows
    take cuBLAS and the kernels apart."""
    import kernels.decode_attention as decode_attention
    import kernels.rmsnorm as rmsnorm
    import kernels.rope as rope
    from engine.loader import load_model
    from engine.packed_prefill import prompt_logits
    from kernels.dispatch import unfolded_norms
    from kernels import float_linear
    from kernels.split_k import FEW_ROWS

    # A narrower MLP: fewer gate/up programs in the interpreter; down's 96 inputs still end in a partial K step.
    path, hf = tiny_model_dir(shape, intermediate_size=96)
    model = load_model(path, torch.float32, torch.device("cpu"))
    layers = model.cfg.num_layers
    calls: dict[str, int] = {"norm": 0, "rope": 0, "merge": 0}
    norm_kernel, rope_kernel = rmsnorm.rms_norm_triton, rope.rope_store_kv_triton

    def counted(name, kernel):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or kernel(*a, **k)

    monkeypatch.setattr(rmsnorm, "rms_norm_triton", counted("norm", norm_kernel))
    monkeypatch.setattr(rope, "rope_store_kv_triton", counted("rope", rope_kernel))
    monkeypatch.setattr(decode_attention, "merge_splits", counted("merge", decode_attention.merge_splits))

    def run(prompt: list[int]) -> tuple[torch.Tensor, dict[str, int]]:
        calls.update(norm=0, rope=0, merge=0)
        logits = prompt_logits(model, prompt)
        with torch.no_grad():
            torch.testing.assert_close(logits, hf(torch.tensor([prompt])).logits[0].float(), atol=1e-4, rtol=1e-4)
        return logits, dict(calls)

    folded, counts = run([7])
    assert counts == {"norm": 1, "rope": 0, "merge": 0}  # the last: the first is the embedding kernel's
    with unfolded_norms():
        apart, counts = run([7])
    assert counts == {"norm": 2 * layers, "rope": 0, "merge": layers}
    torch.testing.assert_close(folded, apart, atol=1e-5, rtol=1e-5)
    # past FLOAT_FUSED_ROWS: cuBLAS
    assert run([5, 7, 9])[1] == {"norm": 2 * layers, "rope": layers, "merge": 0}
    monkeypatch.setitem(float_linear.FLOAT_FUSED_ROWS, torch.float32, FEW_ROWS)
    assert run([5, 7, 9])[1] == {"norm": 1, "rope": 0, "merge": 0}  # the few-row kernel
    assert run(list(range(3, 4 + FEW_ROWS)))[1] == {"norm": 2 * layers, "rope": layers, "merge": 0}
