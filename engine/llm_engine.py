"""The engine: requests in, one step at a time, token deltas out per request."""
from __future__ import annotations

import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import ContextLengthError, InvalidRequestError, ModelLoadError
from engine.model_runner import StepInputs
from engine.model_store import resolve_model
from engine.models.llama import DecoderModel
from engine.outputs import RequestOutput, RequestTimes, SampleDelta, Usage
from engine.sampler import SampleRow, SamplerOutput, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from engine.sequence import Request, Sequence, placeholder
from engine.speculative import METHODS, Lookahead, NgramProposer, Proposer, SpeedGate, SuffixProposer, accepted
from engine.grammar_worker import Grammar, GrammarWorker, worker_processes
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Chat, IncrementalDetokenizer, Tokenizer
from engine.builder import build_runner, context_length, draft_batch, kv_cache_blocks, load_draft, load_shard, model_source
from engine.draft_model import DraftModelProposer
from engine.workers import start_tensor_parallel

log = logging.getLogger("minillm.engine")

Prompt = str | list[int] | list[dict[str, Any]] | Chat  # text, token ids, or chat messages


@dataclass
class _InFlight:
    """A launched step: who samples, where each token goes, and the sampled ids still on the device."""

    sampling: list[ScheduledSequence]
    positions: list[int]  # per sample, the index in its token_ids of its first draft, else of its placeholder
    sampled: SamplerOutput | None  # None while a step with grammar rows waits to sample (next step() call)
    deferred: tuple[torch.Tensor, list[SampleRow]] | None = None  # its logits and rows until then
    constrained: bool = False  # some row has a grammar: it samples late, and its tokens feed grammars
    masked: bool = False  # the grammar worker fills its masks (sent once the step before is read)
    # Prompt logprobs computed in this step, and per request how many of them are its.
    prompt: tuple[SamplerOutput, list[tuple[Request, int]]] | None = None
    decode_only: bool = False  # every sequence decodes (some with drafts): a step the speed gate times
    rows: int = 0  # sampled ids: a row a sample and a draft
    waited_at: float | None = None  # when launched, if after the step before it was read (with a lookahead)
    ahead: bool = False  # launched before the step before it, which carried drafts, was read


# A sample's tokens read from a step and put in place, whose text and outputs are still to make
# (LLMEngine._emit): the sample, where the first of them is in its token_ids, their logprobs (one a
# token), whether they are its request's first tokens, and whether a step with drafts made them.
# A tuple: one is made per sample and step.
_Taken = tuple[Sequence, int, list[TokenLogprobs | None], bool, bool]


@dataclass
class EngineStats:
    """Live numbers for metrics; counters only grow."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_bytes_per_block: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    prompt_tokens: int  # of every request added
    computed_prompt_tokens: int  # prompt tokens whose KV was computed: not from the prefix cache
    generation_tokens: int
    constrained_requests: int  # requests with a grammar (structured output, tools)
    grammar_mask_seconds: float  # the grammar worker's time feeding tokens and filling masks
    speculative_method: str | None = None  # the draft source (--speculative-method), if any
    draft_tokens: int = 0  # speculative draft tokens verified
    accepted_draft_tokens: int = 0  # of those, the ones the target's samples confirmed
    speculative_tokens: int = 0  # tokens emitted by steps with drafts: the accepted, and one sample after them


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        _check_speculative(config)
        # Under tensor parallelism this process is rank 0; the other ranks start now and build the
        # same shard, KV cache and runner beside it (engine/workers.py).
        self.tp, self.workers, device = start_tensor_parallel(config)
        try:
            self.model = load_shard(config, self.tp, device)
            self.model_config = self.model.cfg
            source = model_source(config)
            self.tokenizer = self._load_tokenizer(None if isinstance(source, str) else source)
            self.eos_token_ids = (
                self.tokenizer.eos_token_ids if self.tokenizer else frozenset(self.model_config.eos_token_ids)
            )
            # Ids past the tokenizer's (a padded vocabulary) are never sampled.
            # ...nor past the embedding (a tokenizer larger than the model: its extra ids are refused in prompts).
            vocab = self.model_config.vocab_size
            self.sample_vocab_size = min(len(self.tokenizer.hf), vocab) if self.tokenizer else vocab
            draft = (load_draft(config, device, vocab, len(self.tokenizer.hf) if self.tokenizer else None)
                     if config.speculative_method == "draft" else None)
            num_blocks = kv_cache_blocks(config, self.model, self.tp, draft)
            self.max_model_len = context_length(config, self.model, num_blocks)
            self.model_config.check_context(self.max_model_len)
            # No token stands for more characters than its vocabulary entry has, so a prompt longer
            # than this cannot fit the context: refused before the tokenizer spends time on it.
            longest = max(map(len, self.tokenizer.hf.get_vocab()), default=1) if self.tokenizer else 1
            self.max_prompt_chars = self.max_model_len * longest
            self.kv_bytes_per_block = config.block_size * self.model.kv_bytes_per_token()
            self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
            self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.batched_tokens(),
                                       self._proposer(draft, num_blocks), draft_batch(config, device),
                                       SpeedGate() if config.speculative_method and config.speculative_gate else None,
                                       Lookahead() if config.speculative_method and config.speculative_overlap
                                       else None)
            self.runner = build_runner(config, self.model, num_blocks, self.sample_vocab_size,
                                       self.workers.send if self.workers else None)
            self.grammars = (GrammarCompiler.for_tokenizer(self.tokenizer, self.sample_vocab_size, self.eos_token_ids)
                             if self.tokenizer else None)
            self.grammar_worker = (GrammarWorker(self.grammars.info, processes=worker_processes(config.max_num_seqs))
                                   if self.grammars else None)
        except BaseException:
            self.close()
            raise
        self.requests: dict[str, Request] = {}
        self._in_flight: _InFlight | None = None  # the launched step whose tokens are not read yet
        self.clock = time.perf_counter  # the speed gate's and the lookahead's
        self._last_read = self.clock()  # when a step's tokens were last read
        self._landed = 0.0  # when the ids of the step read last reached the host
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.constrained_requests_total = 0
        self.draft_tokens_total = 0
        self.accepted_draft_tokens_total = 0
        self.speculative_tokens_total = 0
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB%s); max_model_len %d",
                 num_blocks, config.block_size, num_blocks * config.block_size,
                 num_blocks * self.kv_bytes_per_block / 2**20, f" on each of {self.tp.size} ranks" if self.tp.size > 1 else "",
                 self.max_model_len)

    def _proposer(self, draft: DecoderModel | None, num_blocks: int) -> Proposer | None:
        """The draft source that --speculative-method names, or None (no speculation)."""
        config = self.config
        if config.speculative_method is None:
            return None
        if config.speculative_method == "suffix":
            return SuffixProposer(config.num_speculative_tokens)
        if config.speculative_method == "ngram":
            return NgramProposer(config.num_speculative_tokens)
        log.info("Draft model %s: its own KV pool of %d blocks (%.1f MiB)", config.speculative_model, num_blocks,
                 num_blocks * config.block_size * draft.kv_bytes_per_token() / 2**20)
        return DraftModelProposer(draft, config.num_speculative_tokens, num_blocks, config.block_size,
                                  self.max_model_len, self.sample_vocab_size, config.max_num_seqs,
                                  config.batched_tokens(), config.cuda_graphs)

    def close(self) -> None:
        """Stop the grammar worker and the other tensor-parallel ranks."""
        if getattr(self, "grammar_worker", None) is not None:  # None too if the engine failed to start
            self.grammar_worker.close()
            self.grammar_worker = None
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def _load_tokenizer(self, model_dir: Path | None) -> Tokenizer | None:
        """--tokenizer's directory, else the model's; a random-weight model may have none."""
        if self.config.tokenizer:
            path = resolve_model(self.config.tokenizer)
            if not Tokenizer.present(path):
                raise ModelLoadError(f"No tokenizer in {path}.")
        elif model_dir is not None and Tokenizer.present(model_dir):
            path = model_dir
        else:
            return None
        return Tokenizer.from_dir(path)

    @property
    def has_chat_template(self) -> bool:
        """Whether chat messages can be sent as a prompt (the tokenizer has a chat template)."""
        return self.tokenizer is not None and self.tokenizer.has_chat_template

    def warm_up(self) -> None:
        """Run one tiny request through every stage (first-call costs land here, not on a client),
        then forget it: counters start from zero. The grammar worker starts too."""
        if self.grammar_worker is not None:
            self.grammar_worker.start()
        self.generate([[self.model_config.bos_token_id or 1] * 4], SamplingParams(max_tokens=1, ignore_eos=True))
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.draft_tokens_total = self.accepted_draft_tokens_total = self.speculative_tokens_total = 0
        self.block_manager.prefix_queries = self.block_manager.prefix_hits = 0
        self.scheduler.num_computed_prompt_tokens = 0

    # ---- requests -------------------------------------------------------------------------------

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        """Tokenize and validate; raises a typed error before anything is queued. Touches no engine state."""
        vocab = self.model_config.vocab_size
        params.validate(vocab_size=self.sample_vocab_size)
        if params.n > self.scheduler.max_num_seqs:  # its samples run side by side
            raise InvalidRequestError(f"n is {params.n}, more than the {self.scheduler.max_num_seqs} sequences this "
                                      "server runs at once (--max-num-seqs).", param="n")
        if self.tokenizer is not None and (chars := _text_chars(prompt)) > self.max_prompt_chars:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the prompt's "
                f"{chars} characters cannot fit in it (at most {self.max_prompt_chars}). Please shorten the prompt.",
                param="prompt" if isinstance(prompt, str) else "messages")
        if isinstance(prompt, str):
            token_ids = self._need_tokenizer().encode(prompt)
        elif not isinstance(prompt, (list, Chat)) or not prompt:
            raise InvalidRequestError("The prompt must be text, token ids or chat messages, and not empty.", param="prompt")
        elif isinstance(prompt, Chat) or all(isinstance(m, dict) for m in prompt):
            token_ids = self._need_tokenizer().apply_chat_template(prompt)  # type: ignore[arg-type]
        elif set(map(type, prompt)) == {int}:  # ids (not bools), checked at C speed: prompts run to 100k+
            token_ids = list(prompt)  # type: ignore[arg-type]
        else:
            raise InvalidRequestError("The prompt must be text, token ids or chat messages, and not empty.", param="prompt")
        if not token_ids:
            raise InvalidRequestError("The prompt is empty after tokenization.", param="prompt")
        room = self.max_model_len - len(token_ids)
        param = "messages" if isinstance(prompt, Chat) or isinstance(prompt[0], dict) else "prompt"  # the field sent
        if min(token_ids) < 0 or max(token_ids) >= vocab:  # sent so, or from a tokenizer larger than the embedding
            raise InvalidRequestError(f"Prompt token ids must be in [0, {vocab}), the model's vocabulary.", param=param)
        if room < 1:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the prompt has "
                f"{len(token_ids)}, leaving no room for a completion. Please shorten the prompt.", param=param)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(token_ids) + params.max_tokens} tokens ({len(token_ids)} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.", param=param)
        if params.structured is not None:  # compiled here, off the engine thread, before anything is sent
            if self.grammars is None:
                raise InvalidRequestError("Structured output needs a tokenizer.", param=params.structured.param)
            if self.grammar_worker is not None:  # it compiles its own copy meanwhile
                self.grammar_worker.prepare(params.structured)
            self.grammars.compile(params.structured)  # raises for a bad spec; the worker keeps the matchers
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=token_ids,
            params=params,
            max_tokens=params.max_tokens or room,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
        )

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError("This model has no tokenizer: send token ids.", param="prompt")
        return self.tokenizer

    def add(self, request: Request) -> None:
        """Queue a request made by make_request (its first sample; the rest fork after the prompt)."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"Duplicate request id {request.request_id}.")
        seed = request.params.seed if request.params.seed is not None else secrets.randbits(62)
        seq = Sequence(request, 0, list(request.prompt_token_ids), seed)
        request.sequences.append(seq)
        self.requests[request.request_id] = request
        self.prompt_tokens_total += request.num_prompt_tokens
        self.constrained_requests_total += request.params.structured is not None
        self.scheduler.add(seq)

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        request = self.make_request(prompt, params, request_id)
        self.add(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (client gone); its blocks return to the pool at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        deltas = []
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                deltas.append(SampleDelta(seq.index, [], "", None, "abort"))
        return RequestOutput(request_id, deltas, self._usage(request), finished=True, times=self._times(request))

    def has_unfinished(self) -> bool:
        """Requests not yet finished (a step in flight for finished ones only is dropped later)."""
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then collect the one before it (overlapped scheduling).

        The device runs step N while the host schedules and launches step N+1, whose inputs name
        step N's tokens by placeholder; only then does the host wait for step N's sampled ids. So
        outputs lag one step, and a sequence that finished in step N computes one token too many.

        A step with grammar rows samples one call later: its masks need step N's tokens, read only
        after its forward launched. The grammar worker fills them from the moment those tokens are
        read, while this thread collects step N and the next call schedules and prepares; that call
        samples it just before its own forward launches behind it.

        A step with drafts moves each sequence by as many tokens as the target accepts, and drafts
        follow the real ids. So the step after it waits for it, unless it goes ahead
        (Scheduler.goes_ahead, with --speculative-overlap): then the next step assumes its
        drafts accepted, its last sample a placeholder, and drafts past a guess of that sample
        (Proposer.guesses). A sequence whose drafts the target then rejects in part rolls back
        (_accept), and its rows in the step launched on them are stale: it loses that step.
        """
        outputs: list[RequestOutput] = []
        prev = read = self._in_flight  # read: the step whose tokens this call reads
        drafting = early = ahead = False
        if prev is not None:
            drafting = self.scheduler.drafting()
            early = drafting or any(s.seq.request.params.penalized for s in prev.sampling)
            if not early and self.scheduler.proposer is not None and any(s.drafts for s in prev.sampling):
                early = not self.scheduler.goes_ahead(prev.sampling)
                ahead = not early  # launched on drafts in flight
        reads = None
        if early:
            # Penalties read the real history, and drafts follow it and move each sequence by as many
            # tokens as the target accepts: let the step in flight land before the next is made. Its
            # text and outputs wait until that one is launched.
            reads = self._read(self._take_in_flight())
            read_at = self.clock()
            prev = None
        out = self.scheduler.schedule()
        prev_rows = prev.rows if prev is not None and prev.sampling else None  # placeholders it may name
        step = self.runner.prepare(out, prev_rows) if out.scheduled else None
        if prev is not None and prev.sampled is None:
            self._sample_deferred(prev)
        launched = self._launch(out, step, prev) if step is not None else None
        if self.scheduler.lookahead is not None:
            self._time_wait(early, launched, read)
            if launched is not None:
                launched.ahead = ahead
        if reads is not None:
            outputs += self._emit(reads)
        if prev is not None:  # the launched step's masks are sent as soon as its tokens are read
            outputs += self._collect(self._take_in_flight(), launched)
            read_at = self.clock()
        elif launched is not None and launched.constrained:  # nothing to read first
            launched.masked = self._fill_masks(launched.sampling)
        # Only now are this step's input ids all real, so the blocks it fills can be hashed.
        self.scheduler.update_computed(out)
        self._in_flight = launched
        if read is not None and (self.scheduler.gate is not None or self.scheduler.lookahead is not None):
            seconds, self._last_read = read_at - self._last_read, read_at  # timed where one was read, one launched
            if self.scheduler.gate is not None:
                self._time_read(read, outputs, drafting or ahead, seconds,
                                timed=launched is not None and (drafting or ahead or not early))
            if self.scheduler.lookahead is not None and launched is not None:
                self._time_ahead(read, outputs, seconds)
        return outputs

    def _time_read(self, read: _InFlight, outputs: list[RequestOutput], drafting: bool, seconds: float, timed: bool
                   ) -> None:
        """Tell the speed gate how fast decode steps go with drafts (each waiting for the one before,
        or launched ahead of it) and without (overlapped): the tokens of the step just read over the
        time since the one before it was read. A step that waited but found nothing to draft is not
        timed: sequences with nothing to propose back off by themselves (speculative.DraftState)."""
        if timed and read.decode_only and read.sampling and drafting == any(s.drafts for s in read.sampling):
            tokens = sum(len(delta.token_ids) for output in outputs for delta in output.deltas)
            self.scheduler.gate.record(drafting, len(read.sampling), tokens, seconds)

    def _time_ahead(self, read: _InFlight, outputs: list[RequestOutput], seconds: float) -> None:
        """Tell the lookahead's gate how fast decode steps go that were launched ahead of a step with
        drafts (stale rows emit nothing) and steps with drafts that waited for the step before."""
        gate = self.scheduler.lookahead.gate
        if gate is None or not read.decode_only or not read.sampling:
            return
        if read.ahead or (read.waited_at is not None and any(s.drafts for s in read.sampling)):
            tokens = sum(len(delta.token_ids) for output in outputs for delta in output.deltas)
            gate.record(read.ahead, len(read.sampling), tokens, seconds)

    def _time_wait(self, early: bool, launched: _InFlight | None, read: _InFlight | None) -> None:
        """Tell the lookahead what a step with drafts that waited for the one before costs: the host's
        work from that one's ids landing to this launch, and the device time of that one, where it
        too was launched after a wait (then it ran alone, from its launch to its ids landing)."""
        now = self.clock()
        if early and launched is not None:
            launched.waited_at = now
            if any(s.drafts for s in launched.sampling):
                waited = read is not None and read.waited_at is not None and any(s.drafts for s in read.sampling)
                self.scheduler.lookahead.record(now - self._landed, self._landed - read.waited_at if waited else None)

    def _sample_deferred(self, in_flight: _InFlight) -> None:
        """Launch the sampling of a step with grammar rows, under the masks filled for it."""
        logits, rows = in_flight.deferred
        mask = self.grammar_worker.masks() if in_flight.masked else None
        in_flight.sampled = self.runner.sample(logits, rows, mask)
        in_flight.deferred = None

    def _take_in_flight(self) -> _InFlight:
        in_flight, self._in_flight = self._in_flight, None
        assert in_flight is not None
        return in_flight

    def _launch(self, out: SchedulerOutput, step: StepInputs, prev: _InFlight | None) -> _InFlight | None:
        now = time.monotonic()
        for s in out.scheduled:
            if s.seq.request.first_scheduled_time is None:
                s.seq.request.first_scheduled_time = now
        # A captured decode step holds no prompt position before a prompt's last: no loop over its batch.
        targets = self._prompt_logprob_rows(out, step) if step.graph_batch is None else None
        sampling = [s for s in out.scheduled if s.samples]
        rows = [row for s in sampling for row in self.runner.sample_rows(s)]
        # Unconstrained steps sample now (a decode graph draws plain rows itself); a step with a grammar
        # row waits for its masks.
        constrained = any(s.seq.request.params.structured is not None for s in sampling)
        logits = self.runner.launch(step, prev.sampled.token_ids if prev is not None and prev.sampling else None,
                                    None if constrained else rows)
        if logits is None:
            return None
        prompt = None
        if targets is not None:
            ids, num_top, spans = targets
            sampled_rows = len(step.logit_rows)
            prompt = (self.runner.prompt_logprobs(logits[sampled_rows:], ids, num_top), spans)
            logits = logits[:sampled_rows]
            if not sampling:
                return _InFlight([], [], SamplerOutput(logits.new_empty(0, dtype=torch.int64)), prompt=prompt)
        sampled = None if constrained else self.runner.sample(logits, rows)
        positions = []
        row = 0
        for s in sampling:  # drafts stand in a sequence's tokens until they are read (_accept)
            seq = s.seq
            positions.append(len(seq.token_ids))
            if s.drafts:
                seq.token_ids += s.drafts
                seq.num_placeholders += len(s.drafts)
                row += len(s.drafts)
            seq.token_ids.append(placeholder(row))
            seq.num_placeholders += 1
            row += 1
        return _InFlight(sampling, positions, sampled, None if sampled else (logits, rows), constrained, prompt=prompt,
                         decode_only=step.decodes, rows=row)

    @staticmethod
    def _prompt_logprob_rows(out: SchedulerOutput, step: StepInputs
                             ) -> tuple[list[int], list[int], list[tuple[Request, int]]] | None:
        """Add to `step` the rows whose logits predict prompt tokens of requests that want their
        logprobs (each position once, even when a preempted prompt is computed again); their target
        ids, top counts and owners. Rows are laid out as StepInputs' input ids: each computing
        sequence's new tokens, in order."""
        targets: list[int] = []
        num_top: list[int] = []
        spans: list[tuple[Request, int]] = []
        row = 0
        for s in out.scheduled:
            seq, request = s.seq, s.seq.request
            if s.num_new_tokens and seq.index == 0 and request.params.prompt_logprobs is not None:
                start = seq.num_computed_tokens  # row + i holds position start + i, which predicts start + i + 1
                first = max(start + 1, request.prompt_logprobs_launched)
                end = min(start + s.num_new_tokens + 1, request.num_prompt_tokens)
                if first < end:
                    step.prompt_rows += range(row + first - 1 - start, row + end - 1 - start)
                    targets += seq.token_ids[first:end]
                    num_top += [request.params.prompt_logprobs] * (end - first)
                    spans.append((request, end - first))
                    request.prompt_logprobs_launched = end
            row += s.num_new_tokens
        if not targets:
            return None
        step.graph_batch = None  # never a decode-only step; said for certain
        return targets, num_top, spans

    def _fill_masks(self, sampling: list[ScheduledSequence]) -> bool:
        """Have the grammar worker fill each constrained row's allowed next tokens (its grammar has
        seen every earlier token); False if no row needs one."""
        keys = []
        feeds: list[int] | None = None  # by row, the draft it follows: only in steps with drafts
        for s in sampling:  # the step's hot loop: kept to attribute reads
            seq = s.seq
            grammar = seq.grammar
            if grammar is None and seq.request.params.structured is not None:
                grammar = self._grammar(seq)
            key = -1 if grammar is None or grammar.ended or seq.is_finished else grammar.key
            keys.append(key)
            if s.drafts:  # a row per draft, each masked by the grammar after the drafts before it
                feeds = feeds if feeds is not None else [-1] * (len(keys) - 1)
                feeds += [-1, *s.drafts]
                keys += [key] * len(s.drafts)
            elif feeds is not None:
                feeds.append(-1)
        return self.grammar_worker.submit(keys, feeds)

    def _grammar(self, seq: Sequence) -> Grammar:
        if seq.grammar is None:  # each sample (forks too) starts at the grammar's beginning
            seq.grammar = self.grammar_worker.grammar(seq.request.params.structured)
        return seq.grammar

    def _collect(self, in_flight: _InFlight, launched: _InFlight | None = None) -> list[RequestOutput]:
        """Read a launched step's tokens (_read), then make its outputs (_emit)."""
        return self._emit(self._read(in_flight, launched))

    def _read(self, in_flight: _InFlight, launched: _InFlight | None = None) -> list[_Taken]:
        """Wait for a launched step's sampled ids (sampling it first if it waits to) and put them in
        place: in place of their placeholders, or after a sequence's confirmed drafts, with its KV
        and its end by token id (end of sequence, stop ids, length). The text, which stop strings
        need, is left to _emit: a step with drafts, which waits for this one, is launched before it.
        If the step launched after it has grammar rows, their masks are sent to the grammar worker
        first: it fills them while this thread does the rest."""
        if in_flight.sampled is None:
            self._sample_deferred(in_flight)
        if in_flight.prompt is not None:
            prompt, spans = in_flight.prompt
            taken = 0
            for request, count in spans:
                request.prompt_logprobs += prompt.logprobs[taken: taken + count]
                taken += count
        token_ids, logprobs = in_flight.sampled.token_id_list, in_flight.sampled.logprobs
        self._landed = self.clock()
        if in_flight.masked:  # each filled row's grammar takes its token (in the worker, with the next step)
            self.grammar_worker.accept(token_ids)
        if launched is not None and launched.constrained:  # a row finishing now gets a mask it won't use
            launched.masked = self._fill_masks(launched.sampling)
        reads = []
        row = 0
        now = time.monotonic()
        for s, position in zip(in_flight.sampling, in_flight.positions):
            seq, request = s.seq, s.seq.request
            row += 1 + len(s.drafts)
            if seq.is_finished or s.stale:  # aborted, done or rolled back in the step before: surplus
                continue
            first = request.first_token_time is None
            if first:
                request.first_token_time = now
            if s.drafts:
                reads.append(self._accept(s, position, token_ids[row - 1 - len(s.drafts):row],
                                          logprobs[row - 1 - len(s.drafts):row], first, launched))
            else:
                seq.token_ids[position] = token_id = token_ids[row - 1]
                seq.num_placeholders -= 1
                self._ends(seq, position, token_id)
                reads.append((seq, position, [logprobs[row - 1]], first, False))
        return reads

    def _accept(self, s: ScheduledSequence, start: int, sampled: list[int], logprobs: list[TokenLogprobs | None],
                first: bool, launched: _InFlight | None) -> _Taken:
        """A sequence's drafts (from `start` in its token_ids) against the target's samples at their
        positions: the confirmed drafts and the sample after them become its tokens. The rejected
        ones go, with the tokens of any step launched on them (whose rows for it are then stale),
        their KV is no longer counted, and the blocks only they used go back to the pool."""
        seq, k = s.seq, len(s.drafts)
        confirmed = accepted(s.drafts, sampled)
        self.draft_tokens_total += k
        self.accepted_draft_tokens_total += confirmed
        seq.drafting.record(k, confirmed, self.scheduler.proposer.num_tokens)
        tokens = seq.token_ids
        if confirmed == k:  # the drafts stand; the sample after them takes the placeholder
            tokens[start + k] = sampled[k]
            seq.num_placeholders -= k + 1
        else:
            del tokens[start + confirmed:]
            tokens.append(sampled[confirmed])
            seq.num_placeholders = 0
            seq.num_computed_tokens = min(seq.num_computed_tokens, start + confirmed)  # its last and the confirmed
            self.block_manager.trim(seq)
            if launched is not None:
                for t in launched.sampling:
                    if t.seq is seq:
                        t.stale = True
        count = confirmed + 1
        for i in range(count):
            if self._ends(seq, start + i, tokens[start + i]):  # finish() already gave its blocks back
                count = i + 1
                del tokens[start + count:]
                break
        if not seq.is_finished:
            self.block_manager.cache_full_blocks(seq, start - 1)
        return seq, start, logprobs[:count], first, True

    def _ends(self, seq: Sequence, position: int, token_id: int) -> bool:
        """Whether the token now at `position` ends the sample by its id or the sample's length
        (the sample is finished then); stop strings are _emit's to find."""
        request = seq.request
        grammar = seq.grammar
        if grammar is not None and token_id in self.eos_token_ids:  # even under ignore_eos
            grammar.ended = True
        if token_id in request.eos_token_ids or token_id in request.params.stop_token_ids or (
                grammar is not None and grammar.ended):
            self.scheduler.finish(seq, "stop")
        elif position + 1 - request.num_prompt_tokens >= request.max_tokens or position + 1 >= self.max_model_len:
            self.scheduler.finish(seq, "length")
        else:
            return False
        return True

    def _emit(self, reads: list[_Taken]) -> list[RequestOutput]:
        """The outputs of tokens put in place by _read: each sample's text and its end, by request."""
        outputs: dict[str, RequestOutput] = {}
        for taken in reads:
            request = taken[0].request
            delta = self._text(taken)
            ro = outputs.get(request.request_id)
            if ro is None:
                ro = outputs[request.request_id] = RequestOutput(request.request_id,
                                                                 prompt_token_ids=request.prompt_token_ids)
            if taken[3] and request.params.prompt_logprobs is not None:
                ro.prompt_logprobs = [None, *request.prompt_logprobs]
            ro.deltas.append(delta)
        for ro in outputs.values():
            request = self.requests[ro.request_id]
            ro.usage = self._usage(request)
            if request.is_finished:
                ro.finished = True
                ro.times = self._times(request)
                del self.requests[ro.request_id]
        return list(outputs.values())

    def _text(self, taken: _Taken) -> SampleDelta:
        """A sample's new tokens as final text, and its end: one _read found, or a stop string (_cut)."""
        seq, start, logprobs, _, drafted = taken
        token_ids = seq.token_ids[start: start + len(logprobs)]
        detokenizer = seq.detokenizer
        if detokenizer is None and self.tokenizer is not None:
            params = seq.request.params
            detokenizer = seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                                   params.stop)
        text = ""
        reason = stop_reason = None
        if detokenizer is not None:
            eos = seq.request.eos_token_ids
            for i, token_id in enumerate(token_ids):
                # An end-of-sequence token ends the text; it is not part of it (even with special tokens shown).
                if token_id not in eos:
                    text += detokenizer.add(token_id)
                    if detokenizer.stop_hit is not None:
                        reason, stop_reason = "stop", self._cut(seq, start, token_ids, i + 1)
                        token_ids, logprobs = token_ids[: i + 1], logprobs[: i + 1]
                        break
        if reason is None and seq.finish_reason is not None:  # _read ended it, at its last token
            reason = seq.finish_reason
            stop_reason = token_ids[-1] if reason == "stop" else None
            if detokenizer is not None:
                text += detokenizer.flush()  # held-back text was not a stop string after all...
                if detokenizer.stop_hit is not None and reason == "length":  # ...unless it now is
                    reason = seq.finish_reason = "stop"
                    stop_reason = detokenizer.stop_hit
        self.generation_tokens_total += len(token_ids)
        if drafted:
            self.speculative_tokens_total += len(token_ids)
        return SampleDelta(seq.index, token_ids, text, None if logprobs[0] is None else logprobs, reason, stop_reason)

    def _cut(self, seq: Sequence, start: int, token_ids: list[int], count: int) -> str | int:
        """End a sample at the count-th of its new tokens (token_ids, from `start` in its token_ids),
        which completed a stop string; the tokens after it are dropped (a step with drafts confirms
        several at once). The stop reason: that stop string, or the token's id where _read ended the
        sample there by it (ids are checked first)."""
        by_token = count == len(token_ids) and seq.is_finished and seq.finish_reason == "stop"
        if not seq.is_finished:
            self.scheduler.finish(seq, "stop")
        seq.finish_reason = "stop"
        del seq.token_ids[start + count:]
        return token_ids[count - 1] if by_token else seq.detokenizer.stop_hit

    @staticmethod
    def _times(request: Request) -> RequestTimes:
        now = time.monotonic()
        scheduled = request.first_scheduled_time or now
        first_token = request.first_token_time or now
        return RequestTimes(queue=scheduled - request.arrival_time, prefill=first_token - scheduled,
                            decode=now - first_token, total=now - request.arrival_time)

    @staticmethod
    def _usage(request: Request) -> Usage:
        # Once per request and step: a plain loop, no generator (bench/host_step.py).
        prompt = request.num_prompt_tokens
        completion = 0
        for s in request.sequences:
            completion += s.num_real_tokens - prompt
        cached = request.sequences[0].num_cached_prompt_tokens if request.sequences else 0
        return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=self.scheduler.num_waiting,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            kv_bytes_per_block=self.kv_bytes_per_block,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_total,
            computed_prompt_tokens=self.scheduler.num_computed_prompt_tokens,
            generation_tokens=self.generation_tokens_total,
            constrained_requests=self.constrained_requests_total,
            grammar_mask_seconds=self.grammar_worker.mask_seconds if self.grammar_worker else 0.0,
            speculative_method=self.config.speculative_method,
            draft_tokens=self.draft_tokens_total,
            accepted_draft_tokens=self.accepted_draft_tokens_total,
            speculative_tokens=self.speculative_tokens_total,
        )

    # ---- offline use (CLI, tests, benchmarks) ---------------------------------------------------

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts to completion in one continuous batch; results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp).request_id for p, sp in zip(prompts, params_list)]
        results = {rid: Completion(rid) for rid in ids}
        while self.has_unfinished():
            for ro in self.step():
                results[ro.request_id].extend(ro)
        return [results[rid] for rid in ids]


def _check_speculative(config: EngineConfig) -> None:
    """Refuse speculative flags that do not fit together, before anything loads."""
    method = config.speculative_method
    if method is None:
        if config.speculative_model is not None:
            raise InvalidRequestError("--speculative-model needs --speculative-method draft.", param="speculative_model")
        return
    if method not in METHODS:
        raise InvalidRequestError(f"--speculative-method must be one of {', '.join(METHODS)}, not {method!r}.",
                                  param="speculative_method")
    if config.num_speculative_tokens < 1:
        raise InvalidRequestError("--num-speculative-tokens must be at least 1.", param="num_speculative_tokens")
    if (method == "draft") != (config.speculative_model is not None):
        raise InvalidRequestError("--speculative-method draft needs --speculative-model, and only it takes one.",
                                  param="speculative_model")
    if method == "draft" and config.tensor_parallel_size != 1:
        raise InvalidRequestError("--speculative-method draft runs with --tensor-parallel-size 1 only.",
                                  param="speculative_method")


def _text_chars(prompt: Prompt) -> int:
    """Characters of prompt text that become tokens for sure: a text prompt's, or the content of a
    chat's messages other than the assistant's (a template may drop parts of those)."""
    if isinstance(prompt, str):
        return len(prompt)
    messages = prompt.messages if isinstance(prompt, Chat) else prompt
    chars = 0
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            return 0  # token ids
        if m.get("role") == "assistant":
            continue
        content = m.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return chars


@dataclass
class SampleResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Completion:
    """A finished request gathered from its deltas (offline use)."""

    request_id: str
    samples: dict[int, SampleResult] = field(default_factory=dict)
    usage: Usage | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def extend(self, ro: RequestOutput) -> None:
        self.prompt_logprobs = self.prompt_logprobs or ro.prompt_logprobs
        for d in ro.deltas:
            r = self.samples.setdefault(d.index, SampleResult())
            r.token_ids += d.token_ids
            r.text += d.text
            r.logprobs += d.logprobs or []
            r.finish_reason = d.finish_reason or r.finish_reason
        self.usage = ro.usage

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids if self.samples else []

    @property
    def text(self) -> str:
        return self.samples[0].text if self.samples else ""
