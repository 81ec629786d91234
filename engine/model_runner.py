"""Runs one scheduled step on the device: batch inputs, the forward over the paged KV cache, sampling."""
from __future__ import annotations

import torch

from engine.models.llama import DecoderModel
from engine.sampler import SampleRow, Sampler, SamplerOutput
from engine.scheduler import ScheduledSequence, SchedulerOutput
from kernels.attention import AttentionMetadata


class ModelRunner:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, max_model_len: int) -> None:
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        dtype = model.embed_tokens.weight.dtype
        # One pool per layer, K and V side by side: [layers, 2, blocks, block_size, kv_heads, head_dim].
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=self.device
        )
        model.init_rope(max_model_len)
        self.sampler = Sampler()

    def _tensor(self, data: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> SamplerOutput | None:
        """Compute the scheduled tokens; sample where a sequence reached its end. None if nothing samples."""
        for src, dst in out.block_copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        computing = [s for s in out.scheduled if s.num_new_tokens]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        last_row: dict[int, int] = {}  # seq_id -> row of its last computed token
        bs = self.block_size
        for s in computing:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += (seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(len(input_ids))
            last_row[seq.seq_id] = len(input_ids) - 1
        seq_lens = [s.seq.num_computed_tokens + s.num_new_tokens for s in computing]
        width = max(len(s.seq.block_table) for s in computing)
        tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in computing]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            query_start_loc=self._tensor(query_start, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(tables, torch.int32).view(len(computing), width),
            query_lens_cpu=[s.num_new_tokens for s in computing],
            seq_lens_cpu=seq_lens,
        )
        hidden = self.model(self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), self.kv_cache, meta)
        sampling = [s for s in out.scheduled if s.samples]
        if not sampling:
            return None
        rows = [last_row[(s.sample_from or s.seq).seq_id] for s in sampling]
        logits = self.model.compute_logits(hidden[self._tensor(rows, torch.int64)])
        return self.sampler(logits, [self._sample_row(s) for s in sampling])

    @staticmethod
    def _sample_row(s: ScheduledSequence) -> SampleRow:
        seq = s.seq
        return SampleRow(
            params=seq.request.params,
            seed=seq.seed,
            counter=seq.num_tokens,
            prompt_token_ids=seq.request.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
        )
