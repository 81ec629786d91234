"""Runs one scheduled step on the device: batch inputs, the forward over the paged KV cache, sampling.

On CUDA, decode-only steps replay a CUDA graph captured for the next of GRAPH_BATCH_SIZES (padded,
up to --max-num-seqs): the whole forward and the logits are one launch. A step whose
sequences all decode, some with drafts (a verify step), is laid out as decode rows, a row per token,
so it replays them too. Steps with prefill chunks replay a prefill graph padded to the next of
PREFILL_GRAPH_TOKENS where they fit one, else run eagerly.

Nothing here waits for the device. A step is launched while the previous one still runs, so its
input ids may be placeholders (see engine.sequence.placeholder) for tokens that the previous
step is still sampling: they are taken from that step's device output, inside the graph.

Under tensor parallelism every rank has a runner over its shard. Rank 0's `prepare` turns the
scheduler's output into StepInputs, `launch` publishes them to the other ranks, and `sample`
samples; the others `follow` each step with the same forward (collectives included, graphs
too) and take rank 0's sampled ids by broadcast, for their next placeholders.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.models.llama import DecoderModel
from engine.sampler import HostIds, SampleRow, Sampler, SamplerOutput
from engine.scheduler import ScheduledSequence, SchedulerOutput
from kernels.attention import AttentionMetadata
from kernels.dispatch import pinned, programmatic_launches, to_device, use_triton
from kernels.sampling import gumbel_argmax_triton
from kernels.staging import HEAD, maps_pinned_memory, stage

log = logging.getLogger("minillm.engine")

# A batch replays the next size's graph, padded, at that size's cost: every size to 8 rows (a verify
# step of 4 drafts at one sequence is 5 rows), then steps of 8 to 64 with 12, of 16 to 128 (docs/performance.md).
GRAPH_BATCH_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 192, 256)
# Steps with prefill chunks (or drafts) replay a graph too, padded to the next of these token counts:
# launched one by one from the host, a short prefill's kernels take longer to launch than to run.
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
PREFILL_GRAPH_SEQS = 16  # sequences (chunks, and decodes beside them) a prefill graph takes
PREFILL_GRAPH_ROWS = 64  # logit rows it computes (a row per sample, drafts included)


def cache_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV cache slots of positions start..end-1, a block's run at a time; a long prompt's through
    numpy, as they are built before its first kernel launches."""
    first = start // block_size
    if end - start > 4 * block_size:
        blocks = np.asarray(block_table[first : (end - 1) // block_size + 1], dtype=np.int64) * block_size
        offset = first * block_size
        return (blocks[:, None] + np.arange(block_size)).ravel()[start - offset : end - offset].tolist()
    slots: list[int] = []
    while start < end:
        stop = min(end, (start // block_size + 1) * block_size)
        first = block_table[start // block_size] * block_size + start % block_size
        slots += range(first, first + stop - start)
        start = stop
    return slots


def capture(forward: Callable[[], torch.Tensor], pool: object) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of forward() and its output, warmed up first outside the capture (Triton
    compiles, cuBLAS picks its algorithms)."""
    for _ in range(2):
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


# The most block-table entries (rows before the last whole, at max_blocks each) a decode graph's one
# input copy carries; past them (several rows of a long max_model_len) the tables get a copy of
# their own, of the used corner only.
ONE_COPY_TABLE_ENTRIES = 16384


def inputs_with_tables(inputs: np.ndarray, tables: list[list[int]], max_blocks: int, scratch_block: int
                       ) -> np.ndarray | None:
    """A decode graph's buffer up to the last table entry the step uses, as int32: its inputs (int64
    [8, batch]), then the tables' rows at max_blocks each (the entries past a row's blocks the scratch
    block); None past ONE_COPY_TABLE_ENTRIES."""
    span = (len(tables) - 1) * max_blocks + max(map(len, tables))
    if span > ONE_COPY_TABLE_ENTRIES:
        return None
    head = inputs.reshape(-1).view(np.int32)
    host = np.full(len(head) + span, scratch_block, dtype=np.int32)
    host[: len(head)] = head
    for row, table in enumerate(tables):
        start = len(head) + row * max_blocks
        host[start: start + len(table)] = table
    return host


def copy_tables(dst: torch.Tensor, tables: list[list[int]], scratch_block: int) -> None:
    """A step's block tables into a graph's static table. Only the blocks each sequence has are read,
    so only that corner is refreshed (rows padded with the scratch block): one pinned copy."""
    width = max(len(t) for t in tables)
    rows = [t + [scratch_block] * (width - len(t)) for t in tables]
    dst[: len(tables), :width].copy_(pinned(rows, torch.int32), non_blocking=True)


class _HostRing:
    """Pinned host rows that the decode graphs' draw writes its ids into, so that a step's ids reach
    the host with no copy after its graph (a copy's start costs the device more than the copy). Step
    k takes row k % ROWS; the engine reads a step's ids before it launches the step after the next,
    and HostIds checks that the row was not taken again before it was read."""

    ROWS = 4

    def __init__(self, width: int, device: torch.device) -> None:
        self.ids = torch.zeros(self.ROWS, width, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.uses = [0] * self.ROWS
        self.taken = 0

    def take(self) -> int:
        row = self.taken % self.ROWS
        self.taken += 1
        self.uses[row] += 1
        return row

    def read(self, row: int, n: int) -> HostIds:
        return HostIds(self.ids[row, :n], self.uses, row, self.uses[row])


class _InputRing:
    """Pinned host rows that the decode graphs' first kernel reads their inputs from
    (kernels/staging.py), so no copy to the device precedes the graph. Step k writes row k % ROWS,
    headed by k and the graph's batch, after the graph that read it ROWS steps before has (the
    kernel notes each row it consumed)."""

    ROWS = 4

    def __init__(self, width: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.rows = torch.zeros(self.ROWS, HEAD + width, dtype=torch.int32, pin_memory=pin)
        self.consumed = torch.full((self.ROWS,), -1, dtype=torch.int64, pin_memory=pin)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)  # the graphs count on
        self._rows, self._consumed = self.rows.numpy(), self.consumed.numpy()
        self.taken = 0

    def put(self, values: np.ndarray, batch: int) -> None:
        """The inputs (int32; none: a copy put them there) of the next replay, of the graph of `batch`."""
        step, row = self.taken, self.taken % self.ROWS
        if step >= self.ROWS and self._consumed[row] < step - self.ROWS:
            if self.counter.is_cuda:  # the engine reads steps sooner; a bench may not
                torch.cuda.current_stream().synchronize()
            if self._consumed[row] < step - self.ROWS:
                raise RuntimeError("a decode graph did not consume its inputs")
        self._rows[row, :HEAD] = (step & ((1 << 31) - 1), batch, len(values))
        self._rows[row, HEAD: HEAD + len(values)] = values
        self.taken += 1


class _DecodeGraph:
    """Static input buffers and one captured forward + logits for decode batches of `batch` rows."""

    def __init__(self, runner: "ModelRunner", batch: int, pool: object) -> None:
        dev, max_blocks = runner.device, runner.max_blocks_per_seq
        self.batch = batch
        # Input ids (placeholders included), positions, slots, lengths, each row's first key written
        # this step, its draw (seed, counter, temperature as float32 bits) and the host ring's row the
        # draw writes (every entry the same) as int64 [9, batch], then the block tables as int32
        # [batch, max_blocks]: one buffer, one copy a step where the tables' used part is near its
        # start (run).
        self.max_blocks = max_blocks
        self.buffer = torch.full((18 * batch + batch * max_blocks,), runner.scratch_block, dtype=torch.int32,
                                 device=dev)
        self.inputs = self.buffer[: 18 * batch].view(torch.int64).view(9, batch)
        self.inputs.zero_()
        self.inputs[2] = runner.scratch_slot
        self.inputs[3] = 1
        self.input_ids, self.positions, self.slots = self.inputs[0], self.inputs[1], self.inputs[2]
        self.seq_lens, self.fresh = self.inputs[3], self.inputs[4]  # int64: decode attention reads either width
        self.tables = self.buffer[18 * batch:].view(batch, max_blocks)
        self.meta = AttentionMetadata.for_decode_graph(self.slots, self.seq_lens, self.tables,
                                                       runner.model.num_kv_heads, self.fresh)
        model, kv, vocab = runner.model, runner.kv_cache, runner.sampler.vocab_size
        self.prev_tokens = runner.prev_tokens  # shared by every graph: the previous step's sampled ids
        host = (runner.host_ring.ids, self.inputs[8]) if runner.host_ring is not None else None
        ring = self.ring = runner.input_ring

        def forward() -> torch.Tensor:
            if ring is not None:  # the inputs, from the host ring's row for this step
                stage(ring.rows, ring.counter, ring.consumed, self.buffer, batch)
            # In the model's dtype: the draw reads it as float32 itself, and the sampler casts what it
            # takes, so the step has no cast kernel.
            hidden = model(self.input_ids, self.positions, kv, self.meta, self.prev_tokens)
            logits = model.compute_logits(hidden, dtype=None)
            # The draw of rows that need nothing else (Sampler.draws): no sampler launches on the host.
            # Drawn into prev_tokens, where the next step's placeholders look, after this step read them.
            self.drawn = gumbel_argmax_triton(logits[:, :vocab], self.inputs[7], self.inputs[5], self.inputs[6],
                                              out=self.prev_tokens[:batch], host=host)
            return logits

        with programmatic_launches():  # kernels/dispatch.py: each kernel starts as the one before ends
            self.graph, self.logits = capture(forward, pool)

    def run(self, step: "StepInputs", scratch_slot: int, scratch_block: int,
            draws: tuple[list[float], list[int], list[int]] | None = None, ring_row: int = 0) -> torch.Tensor:
        """Load this step's inputs (and its rows' draws, else greedy ones) into the static buffers,
        replay, return the first n rows' logits (their drawn ids in self.drawn[:n], and in the host
        ring's row ring_row)."""
        n, pad = len(step.input_ids), self.batch - len(step.input_ids)
        # Padding rows write only to the scratch slot and read one cached token (whatever their
        # stale table row points to); their logits are dropped.
        fresh = step.positions if step.fresh is None else step.fresh  # a decode's first new key: its own
        temperatures, seeds, counters = draws or ([0.0] * n, [0] * n, [0] * n)
        bits = np.asarray(temperatures, dtype=np.float32).view(np.int32).tolist()
        inputs = np.array([step.input_ids + [0] * pad, step.positions + [0] * pad, step.slots + [scratch_slot] * pad,
                           step.seq_lens + [1] * pad, fresh + [0] * pad, seeds + [0] * pad, counters + [0] * pad,
                           bits + [0] * pad, [ring_row] * self.batch], dtype=np.int64)
        host = inputs_with_tables(inputs, step.block_tables, self.max_blocks, scratch_block)
        if host is not None and self.ring is not None:  # the graph reads them itself
            self.ring.put(host, self.batch)
        elif host is not None:  # one copy
            self.buffer[: len(host)].copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)
        else:
            self.inputs.copy_(torch.from_numpy(inputs).pin_memory(), non_blocking=True)
            copy_tables(self.tables, step.block_tables, scratch_block)
            if self.ring is not None:
                self.ring.put(np.empty(0, dtype=np.int32), self.batch)  # the kernel copies nothing
        self.graph.replay()
        return self.logits[:n]


class _PrefillGraph:
    """Static input buffers and one captured forward + logits for steps of up to `tokens` tokens
    over up to PREFILL_GRAPH_SEQS sequences. Padding tokens write to the scratch slot; padding
    sequences have no queries, so attention skips them (its grid covers `tokens` queries each)."""

    def __init__(self, runner: "ModelRunner", tokens: int, pool: object) -> None:
        dev, seqs = runner.device, PREFILL_GRAPH_SEQS
        self.tokens = tokens
        self.inputs = torch.zeros(3, tokens, dtype=torch.int64, device=dev)  # ids, positions, slots
        self.inputs[2] = runner.scratch_slot
        self.input_ids, self.positions, self.slots = self.inputs[0], self.inputs[1], self.inputs[2]
        # Query starts [seqs + 1] then lengths [seqs]: one buffer, one copy a step.
        self.lengths = torch.zeros(2 * seqs + 1, dtype=torch.int32, device=dev)
        self.tables = torch.full((seqs, runner.max_blocks_per_seq), runner.scratch_block, dtype=torch.int32,
                                 device=dev)
        self.logit_rows = torch.zeros(PREFILL_GRAPH_ROWS, dtype=torch.int64, device=dev)
        meta = AttentionMetadata.for_prefill_graph(self.slots, self.lengths[: seqs + 1], self.lengths[seqs + 1:],
                                                   self.tables, tokens)
        model, kv = runner.model, runner.kv_cache
        self.prev_tokens = runner.prev_tokens

        def forward() -> torch.Tensor:
            hidden = model(self.input_ids, self.positions, kv, meta, self.prev_tokens)
            return model.compute_logits(hidden[self.logit_rows])

        self.graph, self.logits = capture(forward, pool)

    def run(self, step: "StepInputs", scratch_slot: int, scratch_block: int) -> torch.Tensor:
        """Load this step's inputs into the static buffers, replay, return its logit rows' logits."""
        n, pad, seqs = len(step.input_ids), self.tokens - len(step.input_ids), PREFILL_GRAPH_SEQS
        starts = [0, *itertools.accumulate(step.query_lens)]
        lengths = starts + [n] * (seqs + 1 - len(starts)) + step.seq_lens + [0] * (seqs - len(step.seq_lens))
        host = pinned([step.input_ids + [0] * pad, step.positions + [0] * pad, step.slots + [scratch_slot] * pad],
                      torch.int64)
        self.inputs.copy_(host, non_blocking=True)
        self.lengths.copy_(pinned(lengths, torch.int32), non_blocking=True)
        rows = step.logit_rows + [0] * (PREFILL_GRAPH_ROWS - len(step.logit_rows))
        self.logit_rows.copy_(pinned(rows, torch.int64), non_blocking=True)
        copy_tables(self.tables, step.block_tables, scratch_block)
        self.graph.replay()
        return self.logits[: len(step.logit_rows)]


@dataclass
class StepInputs:
    """One step's batch as plain host data. Rank 0 makes it from the scheduler's output; under
    tensor parallelism it is all the other ranks receive, and they run the same forward from it."""

    input_ids: list[int]  # negative: a placeholder for a token the previous step is still sampling
    positions: list[int]
    slots: list[int]  # KV cache slot of each token
    query_lens: list[int]  # per sequence: tokens computed in this step
    seq_lens: list[int]  # per sequence: tokens in its KV cache after this step
    block_tables: list[list[int]]
    block_copies: list[tuple[int, int]]  # (src, dst) blocks to copy first (copy-on-write)
    logit_rows: list[int]  # rows whose logits are sampled, in the order of the samples
    graph_batch: int | None  # the batch size of the captured graph that runs this step; None: eager
    has_prev: bool  # the input ids hold placeholders for the previous step's sampled ids
    # Rows whose logits give prompt logprobs, after the sampled rows' (eager steps only: a prompt's
    # positions before its last are never in a decode step).
    prompt_rows: list[int] = field(default_factory=list)
    # Per sequence: its first position computed this step (None: seq_len - query_len). A verify
    # step's decode rows, a row per token, share their sequence's.
    fresh: list[int] | None = None
    decodes: bool = False  # every sequence decodes (some with drafts) and samples its own rows


class ModelRunner:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, max_model_len: int,
                 max_rows: int = 256, use_cuda_graphs: bool = True, sample_vocab_size: int | None = None,
                 publish: Callable[[StepInputs], None] | None = None, max_num_batched_tokens: int = 2048) -> None:
        """`max_rows`: the most decode rows a step has (sequences, and their drafts). `publish`, on
        rank 0 under tensor parallelism, sends each step to the other ranks."""
        cfg = model.cfg
        self.model = model
        self.publish = publish
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        dtype = model.embed_tokens.weight.dtype
        # One pool per layer, K and V side by side: [layers, 2, blocks, block_size, kv_heads, head_dim].
        # One block more than the block manager knows: a scratch block for graph padding rows.
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks + 1, block_size, model.num_kv_heads, cfg.head_dim, dtype=dtype,
            device=self.device,
        )
        self.scratch_block = num_blocks
        self.scratch_slot = num_blocks * block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        model.init_rope(max_model_len)
        self.sampler = Sampler(sample_vocab_size)
        # A decode graph's logits, the ids it drew, and where it wrote them on the host (if it does).
        self._drawn: tuple[torch.Tensor, torch.Tensor, HostIds | None] | None = None
        self.graphs: dict[int, _DecodeGraph] = {}
        self.prefill_graphs: dict[int, _PrefillGraph] = {}  # by token count
        # The previous step's sampled ids, for the graphs' placeholders (a step with more rows runs eagerly).
        self.prev_tokens = torch.zeros(max(GRAPH_BATCH_SIZES), dtype=torch.int64, device=self.device)
        self._followed: torch.Tensor | None = None  # on ranks other than 0: rank 0's last sampled ids
        self.host_ring: _HostRing | None = None
        self.input_ring: _InputRing | None = None
        if use_cuda_graphs and self.device.type == "cuda":
            if maps_pinned_memory(self.device):
                self.host_ring = _HostRing(max(GRAPH_BATCH_SIZES), self.device)
                self.input_ring = _InputRing(18 * max(GRAPH_BATCH_SIZES) + ONE_COPY_TABLE_ENTRIES, self.device)
            else:
                log.warning("decode steps copy their inputs to the device and their sampled ids back")
            self._capture(max_rows, max_num_batched_tokens)

    @torch.inference_mode()
    def _capture(self, max_rows: int, max_num_batched_tokens: int) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse its memory; the prefill graphs share it too (one
        # step runs at a time, and its logits are sampled before the next replays).
        tokens = [t for t in PREFILL_GRAPH_TOKENS if t <= max_num_batched_tokens]
        for count in reversed(tokens):
            self.prefill_graphs[count] = _PrefillGraph(self, count, pool)
        padded = [b for b in GRAPH_BATCH_SIZES if b >= max_rows][:1]  # the size the most rows pad to
        sizes = [b for b in GRAPH_BATCH_SIZES if b < max_rows] + padded
        for batch in reversed(sizes):
            self.graphs[batch] = _DecodeGraph(self, batch, pool)
        log.info("captured CUDA graphs for decode batch sizes %s and prefill token counts %s", sizes, tokens)

    def _tensor(self, data: list[int], dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    @torch.inference_mode()
    def launch(self, step: StepInputs, prev: torch.Tensor | None, rows: list[SampleRow] | None = None
               ) -> torch.Tensor | None:
        """Launch a prepared step's forward; the logits of the rows that sample, or None if none does.
        `prev` holds the sampled ids of the step still in flight, which the placeholders name. With
        `rows` (what `sample` will be given, unmasked), a decode graph draws them itself where it can."""
        if self.publish is not None:
            self.publish(step)
        return self.forward(step, prev, rows)

    @torch.inference_mode()
    def prompt_logprobs(self, logits: torch.Tensor, targets: list[int], num_top: list[int]) -> SamplerOutput:
        """Each prompt row's next prompt token's logprob and top alternatives, their copy to the host started."""
        out = self.sampler.prompt_logprobs(logits, targets, num_top)
        out.start_copy()
        return out

    def sample(self, logits: torch.Tensor, rows: list[SampleRow], mask: torch.Tensor | None = None) -> SamplerOutput:
        """Launch the sampling of launch's logits (one row per sampling sequence, in order) and the
        copy of the ids to the host; the other ranks take them too, for their next placeholders."""
        sampled = self.draw(logits, rows, mask)
        self.model.tp.broadcast(sampled.token_ids)
        sampled.start_copy()
        return sampled

    def draw(self, logits: torch.Tensor, rows: list[SampleRow], mask: torch.Tensor | None = None) -> SamplerOutput:
        """The sampled ids of launch's logits, on the device (no copy started). Rows the decode
        graph drew (launch's rows) are only read: their ids lie in prev_tokens until the next replay."""
        drawn, self._drawn = self._drawn, None
        if drawn is not None and drawn[0] is logits and mask is None:
            return self.sampler.drawn(logits, drawn[1], rows, drawn[2])
        return self.sampler(logits, rows, mask)

    @torch.inference_mode()
    def follow(self, step: StepInputs) -> None:
        """Ranks other than 0: run rank 0's step on this rank's shard, then take its sampled ids."""
        self.forward(step, self._followed if step.has_prev else None)
        if step.logit_rows:
            self._followed = self.model.tp.broadcast(torch.empty(len(step.logit_rows), dtype=torch.int64,
                                                                 device=self.device))

    def prepare(self, out: SchedulerOutput, prev_rows: int | None) -> StepInputs:
        """The step's batch, from the scheduled sequences (host work only). `prev_rows`: how many ids
        the step in flight samples, whose placeholders this step's inputs may hold (None: no step)."""
        computing = [s for s in out.scheduled if s.num_new_tokens]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}  # seq_id -> row of its last computed token
        bs = self.block_size
        for s in computing:
            seq, start = s.seq, s.seq.num_computed_tokens
            if s.num_new_tokens == 1:  # a decode: the common case, kept cheap
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(seq.block_table[start // bs] * bs + start % bs)
            else:
                end = start + s.num_new_tokens
                input_ids += seq.token_ids[start:end] + s.drafts  # drafts: after the sequence's last token
                positions += range(start, end)
                slots += cache_slots(seq.block_table, start, end, bs)
            last_row[seq.seq_id] = len(input_ids) - 1
        sampling = [s for s in out.scheduled if s.samples]
        logit_rows: list[int] = []
        for s in sampling:  # a sequence with k drafts samples its last k + 1 rows
            last = last_row[(s.sample_from or s.seq).seq_id]
            logit_rows += range(last - len(s.drafts), last + 1) if s.drafts else (last,)
        step = StepInputs(
            input_ids=input_ids, positions=positions, slots=slots,
            query_lens=[s.num_new_tokens for s in computing],
            seq_lens=[s.seq.num_computed_tokens + s.num_new_tokens for s in computing],
            block_tables=[s.seq.block_table for s in computing],
            block_copies=out.block_copies,
            logit_rows=logit_rows,
            graph_batch=None,
            has_prev=prev_rows is not None,
            decodes=len(computing) == len(sampling) and all(
                s.samples and not s.sample_from and s.num_new_tokens == 1 + len(s.drafts) for s in computing),
        )
        # Decode rows let a verify step replay decode graphs and run decode attention; the torch
        # reference would gather a sequence's keys once a row, so there it stays a query a sequence.
        if step.decodes and len(input_ids) > len(computing) and use_triton(self.kv_cache):
            self._token_rows(step, computing)
        step.graph_batch = self.graph_for(step, prev_rows) if step.decodes else None
        return step

    @staticmethod
    def _token_rows(step: StepInputs, computing: list[ScheduledSequence]) -> None:
        """Lay out a verify step as decode rows, a row per token: each attends to its sequence's
        keys up to itself, and waits for the whole step's new keys (fresh) before reading them."""
        step.query_lens, step.seq_lens, step.block_tables, step.fresh = [], [], [], []
        for s in computing:
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            step.query_lens += [1] * n
            step.seq_lens += range(start + 1, start + n + 1)
            step.block_tables += [s.seq.block_table] * n
            step.fresh += [start] * n

    def forward(self, step: StepInputs, prev: torch.Tensor | None, rows: list[SampleRow] | None = None
                ) -> torch.Tensor | None:
        """The step's forward on this rank: logits of its sampled rows then its prompt rows, or None
        if it has neither. `prev` holds the previous step's sampled ids, which the placeholders name;
        `rows`, if given, are its sampled rows (a decode graph draws them if Sampler.draws says so)."""
        self._drawn = None
        for src, dst in step.block_copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        graph = self.graphs[step.graph_batch] if step.graph_batch is not None else self._prefill_graph_for(step, prev)
        if graph is not None:
            # Every graph reads its placeholders' ids from prev_tokens, where decode graphs draw theirs.
            if prev is not None and prev.data_ptr() != self.prev_tokens.data_ptr():
                self.prev_tokens[: len(prev)].copy_(prev)
            if not isinstance(graph, _DecodeGraph):
                return graph.run(step, self.scratch_slot, self.scratch_block)
            draws = self.sampler.draws(rows, graph.logits.shape[-1]) if rows else None
            ring_row = self.host_ring.take() if self.host_ring is not None else 0
            logits = graph.run(step, self.scratch_slot, self.scratch_block, draws, ring_row)
            if draws is not None:
                host_ids = self.host_ring.read(ring_row, len(logits)) if self.host_ring is not None else None
                self._drawn = (logits, graph.drawn[: len(logits)], host_ids)
            return logits
        meta = AttentionMetadata.from_host(step.slots, step.query_lens, step.seq_lens, step.block_tables,
                                           self.model.num_kv_heads, self.device, step.fresh)
        hidden = self.model(self._tensor(step.input_ids, torch.int64), self._tensor(step.positions, torch.int64),
                            self.kv_cache, meta, prev)
        rows = step.logit_rows + step.prompt_rows
        if not rows:
            return None
        return self.model.compute_logits(hidden[self._tensor(rows, torch.int64)])

    def graph_for(self, step: StepInputs, prev_rows: int | None) -> int | None:
        """The captured graph of a step of decode rows, each sampling its own logits, if one is large enough."""
        if not self.graphs or (prev_rows is not None and prev_rows > len(self.prev_tokens)):
            return None
        return next((b for b in sorted(self.graphs) if b >= len(step.input_ids)), None)

    def _prefill_graph_for(self, step: StepInputs, prev: torch.Tensor | None) -> _PrefillGraph | None:
        """A captured prefill graph fits a step of no more sequences, logit rows and tokens than it
        takes, without prompt logprobs (their rows vary)."""
        if (not self.prefill_graphs or step.prompt_rows or len(step.query_lens) > PREFILL_GRAPH_SEQS
                or len(step.logit_rows) > PREFILL_GRAPH_ROWS
                or (prev is not None and len(prev) > len(self.prev_tokens))):
            return None
        return next((g for t, g in sorted(self.prefill_graphs.items()) if t >= len(step.input_ids)), None)

    @staticmethod
    def sample_rows(s: ScheduledSequence) -> list[SampleRow]:
        """What sampling needs of a sequence, taken before its placeholder for this step is added:
        one row, or one per position its drafts reach, each keyed by the index it samples."""
        seq, request = s.seq, s.seq.request
        params, num_tokens = request.params, len(seq.token_ids)
        # Penalties read the history (such steps wait for real ids); a draft's row reads the drafts
        # before it too, as the step after them would.
        history = seq.output_token_ids if params.penalized else None
        return [SampleRow(params, seq.seed, num_tokens + i, request.prompt_token_ids,
                          () if history is None else [*history, *s.drafts[:i]])
                for i in range(len(s.drafts) + 1)]
