"""Grammar-constrained decoding with xgrammar: compile a request's grammar once (cached by its spec),
keep one matcher per sequence, and fill the token bitmasks the sampler applies.

A grammar's mask for step N+1 needs step N's token. The engine launches step N+1's forward first,
then collects step N and fills the masks on the host while the device runs that forward; only the
sampling of a batch that holds constrained rows waits for them (engine/llm_engine.py).
"""
from __future__ import annotations

import json
import re
import time
from collections import OrderedDict

import torch
import xgrammar as xgr

from engine.errors import InvalidRequestError
from engine.sampler import TokenMask
from engine.sampling_params import GRAMMAR_KINDS, StructuredOutput
from engine.tokenizer import Tokenizer


class Grammar:
    """One sequence's position in its request's grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.ended = False  # it took a stop token, or refused one: the sample is over


def _choice_grammar(spec: str) -> str:
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("choices must be a non-empty list of strings")
    # EBNF string literals escape as JSON does; characters past U+FFFF stay as they are (not surrogates).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer, keeping the last `cache_size` compiled grammars
    (least recently used out), so a repeated schema pays no compile.

    JSON comes out on one line with OpenAI's separators (", ", ": "): free whitespace lets a small
    model loop on newlines and indents until max_tokens."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: frozenset[int],
                 cache_size: int = 256) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=4, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self.cache_size = cache_size
        self.compiles = 0  # grammars compiled (cache misses)
        self.compile_seconds = 0.0

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of spec; raises InvalidRequestError naming spec.param if it cannot compile."""
        if (compiled := self._cache.get(spec)) is not None:
            self._cache.move_to_end(spec)
            return compiled
        start = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad specs as these
            raise InvalidRequestError(f"Invalid {spec.param}: {_first_line(e)}", param=spec.param) from None
        self.compile_seconds += time.perf_counter() - start
        self.compiles += 1
        self._cache[spec] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        c = self._compiler
        if spec.kind == "json":
            json.loads(spec.spec)  # a clear error for text that is not JSON at all
            return c.compile_json_schema(spec.spec, any_whitespace=False)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        if spec.kind == "choice":
            return c.compile_grammar(_choice_grammar(spec.spec))
        if spec.kind == "grammar":  # EBNF (GBNF) as vLLM's guided_grammar takes, else Lark
            return c.compile_grammar(spec.spec) if "::=" in spec.spec else c.compile_lark(spec.spec)
        if spec.kind == "structural_tag":
            return c.compile_structural_tag(spec.spec)
        raise ValueError(f"unknown kind {spec.kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")


def _first_line(e: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(e).strip() or type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:500]


class GrammarBatch:
    """A step's grammar work in one C++ call each: feed the sampled tokens, fill the next masks. On
    the engine's thread: xgrammar holds the GIL while it works, and on the H200's host handing rows
    to its own threads cost more than the work (8 threads: 1.0 ms a step at batch 8, against 0.07
    ms a row on one)."""

    def __init__(self) -> None:
        self._batch = xgr.BatchGrammarMatcher(1)

    def accept(self, grammars: list[Grammar], token_ids: list[int]) -> list[bool]:
        """Advance each grammar by its token; False where it refused (that grammar is unchanged)."""
        return self._batch.batch_accept_token([g.matcher for g in grammars], token_ids)

    def fill(self, grammars: list[tuple[int, Grammar]], batch: int, vocab_size: int) -> TokenMask:
        """The allowed next tokens of a batch of `batch` rows: each (row, grammar)'s from its
        grammar, every token for the other rows (so the sampler copies the mask as it is)."""
        bitmask = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32,
                             pin_memory=torch.cuda.is_available())
        self._batch.batch_fill_next_token_bitmask([g.matcher for _, g in grammars], bitmask,
                                                  [row for row, _ in grammars])
        return TokenMask(list(range(batch)), bitmask)
