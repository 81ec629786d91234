"""What every rank builds: its shard of the model, a KV cache of the size all ranks agree on, and
a model runner. The engine (rank 0) and each tensor-parallel worker (engine/workers.py) call these."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from engine.config import EngineConfig, parse_bytes
from engine.distributed import TensorParallel
from engine.draft_model import check_vocab
from engine.errors import InvalidRequestError, ModelLoadError
from engine.loader import RANDOM_PREFIX, load_model, model_config
from engine.model_runner import ModelRunner, StepInputs
from engine.model_store import resolve_model
from engine.models.llama import DecoderModel
from engine.models.sharding import ModelShard
from engine.packed_prefill import pack_sequences
from engine.speculative import max_batch

log = logging.getLogger("minillm.engine")


def model_source(config: EngineConfig, model: str | None = None) -> str | Path:
    """A `random:<shape>` name as it is, anything else resolved to its directory (config.model's,
    or another model's such as the speculative draft's)."""
    model = model or config.model
    return model if model.startswith(RANDOM_PREFIX) else resolve_model(model)


def check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse a tensor-parallel size this model or machine cannot run, before any process starts."""
    size = config.tensor_parallel_size
    if size < 1:
        raise InvalidRequestError(f"tensor_parallel_size must be at least 1; got {size}.", param="tensor_parallel_size")
    if size == 1:
        return
    device = config.torch_device()
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise InvalidRequestError(f"tensor_parallel_size {size} needs {size} GPUs; this machine has "
                                  f"{torch.cuda.device_count()}.", param="tensor_parallel_size")
    cfg = model_config(model_source(config))
    if cfg.vocab_size < size:
        raise ModelLoadError(f"A vocabulary of {cfg.vocab_size} cannot be split over {size} ranks.")
    for rank in range(size):  # raises for head counts or AWQ groups that do not split
        ModelShard.of(cfg, rank, size, cfg.quantization)


def load_shard(config: EngineConfig, tp: TensorParallel, device: torch.device) -> DecoderModel:
    return load_model(model_source(config), config.torch_dtype(), device, seed=config.weights_seed,
                      quantization=config.quantization, tp=tp)


def load_draft(config: EngineConfig, device: torch.device, target_vocab: int, tokenizer_vocab: int | None) -> DecoderModel:
    """The speculative draft model (--speculative-model), whole on the target's device and dtype;
    its vocabulary is checked against the target's before its weights load."""
    source = model_source(config, config.speculative_model)
    check_vocab(model_config(source).vocab_size, target_vocab, tokenizer_vocab)
    return load_model(source, config.torch_dtype(), device, seed=config.weights_seed)


# KV bytes per rank on CPU without --kv-cache-memory.
CPU_KV_BUDGET = 1 << 30


def kv_cache_blocks(config: EngineConfig, model: DecoderModel, tp: TensorParallel,
                    draft: DecoderModel | None = None) -> int:
    """KV blocks per rank: what this rank's budget holds, the least over ranks (each holds the
    same blocks of its own heads). A draft model's pool holds as many tokens, from the same budget."""
    device = model.embed_tokens.weight.device
    if config.kv_cache_memory is not None:
        budget = parse_bytes(config.kv_cache_memory)
    elif device.type == "cuda":
        budget = _profiled_kv_budget(config, model)
    else:
        budget = CPU_KV_BUDGET
    per_token = model.kv_bytes_per_token() + (draft.kv_bytes_per_token() if draft is not None else 0)
    blocks = tp.min(budget // (config.block_size * per_token), device)
    if blocks < 2:
        raise InvalidRequestError(f"The KV budget holds {blocks} blocks; give --kv-cache-memory more.")
    return blocks


@torch.inference_mode()
def _profiled_kv_budget(config: EngineConfig, model: DecoderModel) -> int:
    """What --gpu-memory-utilization leaves for KV blocks after the weights and the activations
    of a largest step (a full --max-num-batched-tokens prefill, logits for --max-num-seqs rows)."""
    device = model.embed_tokens.weight.device
    tokens = config.batched_tokens()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    batch = pack_sequences(model, [[0] * tokens], block_size=config.block_size)
    hidden = model(batch.input_ids, batch.positions, batch.kv_cache, batch.meta)
    rows = min(config.max_num_seqs, tokens)
    model.compute_logits(hidden[-rows:])
    torch.cuda.synchronize(device)
    kv = batch.kv_cache
    peak = torch.cuda.max_memory_allocated(device) - kv.numel() * kv.element_size()
    del batch, kv, hidden
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info(device)[1]
    budget = int(total * config.gpu_memory_utilization) - peak
    log.info("GPU memory: %.1f GiB total, %.1f GiB for weights and a largest step, %.1f GiB for KV (utilization %.2f)",
             total / 2**30, peak / 2**30, budget / 2**30, config.gpu_memory_utilization)
    return budget


def context_length(config: EngineConfig, model: DecoderModel, num_blocks: int) -> int:
    """--max-model-len or the model's, no more than the KV pool holds: a longer sequence could never run."""
    return min(config.max_model_len or model.cfg.max_position_embeddings, num_blocks * config.block_size)


def draft_batch(config: EngineConfig, device: torch.device) -> int:
    """Running sequences up to which steps carry drafts (--speculative-max-batch, else by device)."""
    return config.speculative_max_batch or max_batch(device.type)


def decode_rows(config: EngineConfig, device: torch.device) -> int:
    """The most decode rows a step has: a row a sequence, and with speculation a verify step's row a token."""
    if config.speculative_method is None:
        return config.max_num_seqs
    drafting = min(config.max_num_seqs, draft_batch(config, device))
    return max(config.max_num_seqs, drafting * (1 + config.num_speculative_tokens))


def build_runner(config: EngineConfig, model: DecoderModel, num_blocks: int, sample_vocab_size: int | None = None,
                 publish: Callable[[StepInputs], None] | None = None) -> ModelRunner:
    device = model.embed_tokens.weight.device
    if device.type == "cpu" and config.speculative_method is not None:
        model.pack_weights(1 + config.num_speculative_tokens)  # a verify step's rows
    return ModelRunner(model, num_blocks, config.block_size, context_length(config, model, num_blocks),
                       decode_rows(config, device), config.cuda_graphs, sample_vocab_size,
                       publish, config.batched_tokens())
