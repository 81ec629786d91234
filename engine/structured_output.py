"""Compiling grammars with xgrammar: a request's structured-output spec (JSON schema, regex, choice,
EBNF or Lark, structural tag) into a grammar over the tokenizer's ids, cached by spec.

The engine compiles each request's spec on the tokenizer thread, so a bad one is a 400 before
anything is queued. The grammar worker (engine/grammar_worker.py) compiles the same specs again in
its own process, where it keeps one matcher per sequence and fills the masks.
"""
from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import xgrammar as xgr

from engine.errors import InvalidRequestError
from engine.sampling_params import GRAMMAR_KINDS, StructuredOutput

if TYPE_CHECKING:  # the grammar worker's processes import this module, and need no transformers tokenizer
    from engine.tokenizer import Tokenizer


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

    def __init__(self, info: xgr.TokenizerInfo, cache_size: int = 256) -> None:
        self.info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=4, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self.cache_size = cache_size
        self.compiles = 0  # grammars compiled (cache misses)
        self.compile_seconds = 0.0

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: frozenset[int]) -> GrammarCompiler:
        """A compiler over `vocab_size` ids (a padded vocabulary's extra ids are never allowed)."""
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids) or None))

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
            return c.compile_grammar(_strict_strings(xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False)))
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        if spec.kind == "choice":
            return c.compile_grammar(_choice_grammar(spec.spec))
        if spec.kind == "grammar":  # EBNF (GBNF) as vLLM's guided_grammar takes, else Lark
            return c.compile_grammar(spec.spec) if "::=" in spec.spec else c.compile_lark(spec.spec)
        if spec.kind == "structural_tag":  # tool calls: JSON arguments inside
            return c.compile_grammar(_strict_strings(xgr.Grammar.from_structural_tag(spec.spec)))
        raise ValueError(f"unknown kind {spec.kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")


# xgrammar (0.2.8 and 0.2.9) writes a JSON string of bounded length (maxLength, minLength) as a run of
# this class, which lets raw control characters through; JSON forbids them, as its unbounded strings say.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def _strict_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar` with its bounded JSON strings' characters as strict as JSON's."""
    text = str(grammar)
    if _BOUNDED_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def _first_line(e: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(e).strip() or type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:500]
