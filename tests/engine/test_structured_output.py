"""Grammar-constrained decoding (engine/structured_output.py) through the engine.

Most tests run a tiny random-weight model with SmolLM2's tokenizer: its output is noise, so a valid
output is the grammar's doing, not the model's. One test runs the real embedded model, where the
text itself should make sense.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import Completion, LLMEngine
from engine.sampler import Sampler, SampleRow, apply_token_mask
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.grammar_worker import GrammarWorker, GrammarWorkerError, worker_processes
from engine.structured_output import GrammarCompiler

PROMPTS = ["Hello there", "Tell me a story about a dragon", "1 2 3", "The weather today is"]
REGEX = StructuredOutput("regex", r"[a-z]{3}-[0-9]{2}")
# Long enough to take several chunks under the tight engine's token budget.
LONG_PROMPT = "In the beginning the universe was created. This has made a lot of people very angry and " \
              "been widely regarded as a bad move."


# ---- engines ------------------------------------------------------------------------------------

def make_engine(model: Path, tokenizer: Path | None = None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), tokenizer=str(tokenizer) if tokenizer else None,
                                  device="cpu", **kw))


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir) -> Path:
    """A tiny random llama with SmolLM2's vocabulary size, so SmolLM2's tokenizer fits it."""
    return tiny_model_dir("tiny-llama3", vocab_size=49152)[0]


@pytest.fixture(scope="module")
def engine(tiny_dir: Path, default_model_dir: Path) -> LLMEngine:
    return make_engine(tiny_dir, default_model_dir)


@pytest.fixture(scope="module")
def mix_engines(tiny_dir: Path, default_model_dir: Path, engine: LLMEngine) -> dict[str, LLMEngine]:
    """Engines of their own for the mixing property (an engine that raised mid-step is not reused):
    a plain one, and a tight one whose eight KV blocks and 8-token step budget make mixes preempt
    and prompts prefill in chunks."""
    tight = make_engine(tiny_dir, default_model_dir, kv_cache_memory=8 * engine.kv_bytes_per_block,
                        max_num_batched_tokens=8)
    assert tight.block_manager.num_blocks == 8
    return {"plain": make_engine(tiny_dir, default_model_dir), "tight": tight}


def run(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> list[Completion]:
    results = engine.generate(prompts, params)
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0
    return results


def samples(result: Completion) -> list:
    return [result.samples[i] for i in sorted(result.samples)]


# ---- 1. JSON schemas ----------------------------------------------------------------------------
# Every string has a maxLength and every array a maxItems: a random model then always ends.

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"name": {"type": "string", "maxLength": 6},
                                    "id": {"type": "integer", "minimum": 1, "maximum": 999}},
                     "required": ["name", "id"]},
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "ints": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                     "minItems": 1, "maxItems": 4},
            "pairs": {"type": "array", "maxItems": 2,
                      "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}},
                                "required": ["k"]}},
        },
        "required": ["ints", "pairs"],
    },
    "top_level_array": {"type": "array", "items": {"type": "string", "maxLength": 3},
                        "minItems": 1, "maxItems": 3},
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "XL"]},
                       "mixed": {"enum": [1, "two", None, True]}},
        "required": ["color", "size", "mixed"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {"small": {"type": "integer", "minimum": 10, "maximum": 20},
                       "open": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
                       "ratio": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
        "required": ["small", "open", "ratio"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                       "b": {"type": "string", "maxLength": 4},
                       "c": {"type": "boolean"},
                       "d": {"type": "null"}},
        "required": ["a"],
    },
    "patterns": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["code", "zip"],
    },
}
JSON_PARAMS = {"greedy": dict(temperature=0.0, n=3), "seeded": dict(temperature=1.0, seed=7, n=3)}


@pytest.fixture(scope="module")
def json_results(engine: LLMEngine) -> dict[tuple[str, str], Completion]:
    """Every schema under every params, in one batch (one run of engine steps for all)."""
    keys = [(name, kind) for name in SCHEMAS for kind in JSON_PARAMS]
    params = [SamplingParams(max_tokens=120, structured=StructuredOutput.json_schema(SCHEMAS[name]),
                             **JSON_PARAMS[kind]) for name, kind in keys]
    prompts = [PROMPTS[list(SCHEMAS).index(name) % len(PROMPTS)] for name, _ in keys]
    return dict(zip(keys, run(engine, prompts, params)))


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_outputs_validate(json_results, name: str) -> None:
    for kind in JSON_PARAMS:
        for sample in samples(json_results[name, kind]):
            assert sample.finish_reason == "stop", (kind, sample.text)  # the grammar ended, not max_tokens
            jsonschema.validate(json.loads(sample.text), SCHEMAS[name])
            assert "\n" not in sample.text  # compiled without free whitespace
    greedy = [s.text for s in samples(json_results[name, "greedy"])]
    assert greedy[0] == greedy[1] == greedy[2]  # each fork starts the grammar afresh


def test_json_samples_vary(json_results) -> None:
    """The seeded samples are really random, not one fixed output per schema: the grammar leaves the
    model its choices."""
    for name in SCHEMAS:
        assert len({s.text for kind in JSON_PARAMS for s in samples(json_results[name, kind])}) >= 2, name


# ---- 2. the other kinds -------------------------------------------------------------------------

def _tag(name: str, content: dict) -> dict:
    return {"type": "tag", "begin": f"<f={name}>", "content": content, "end": "</f>"}


# JSON content in a structural tag allows free whitespace (xgrammar's choice): contents here have no
# place for it, or a random model pads with spaces until max_tokens.
ADD_SCHEMA = {"type": "integer", "minimum": 0, "maximum": 999}
SAY_SCHEMA = {"enum": ["hi", "bye"]}
STRUCTURAL_TAG = {
    "type": "structural_tag",
    "format": {"type": "triggered_tags", "triggers": ["<f="], "at_least_one": True, "stop_after_first": True,
               "tags": [_tag("add", {"type": "json_schema", "json_schema": ADD_SCHEMA}),
                        _tag("say", {"type": "json_schema", "json_schema": SAY_SCHEMA}),
                        _tag("num", {"type": "regex", "pattern": "[0-9]{1,3}"})]},
}


def _check_tag(text: str) -> None:
    m = re.fullmatch(r"<f=(add|say|num)>(.*)</f>", text, re.DOTALL)
    assert m, text
    name, content = m.groups()
    if name == "num":
        assert re.fullmatch(r"[0-9]{1,3}", content)
    else:
        jsonschema.validate(json.loads(content), ADD_SCHEMA if name == "add" else SAY_SCHEMA)


KINDS = {  # name: (spec, check of one output)
    "regex": (REGEX, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t) is not None),
    "choice": (StructuredOutput.choice(["red", "green", "light blue", "x"]),
               lambda t: t in ("red", "green", "light blue", "x")),
    "ebnf": (StructuredOutput("grammar", 'root ::= "(" [a-c]{1,4} ")" ("," "(" [a-c]{1,4} ")"){0,2}'),
             lambda t: re.fullmatch(r"\([a-c]{1,4}\)(,\([a-c]{1,4}\)){0,2}", t) is not None),
    "lark": (StructuredOutput("grammar", 'start: "x" NUM "!" WORD\nNUM: /[0-9]{2}/\nWORD: /[a-z]{1,3}/'),
             lambda t: re.fullmatch(r"x[0-9]{2}![a-z]{1,3}", t) is not None),
    "structural_tag": (StructuredOutput("structural_tag", json.dumps(STRUCTURAL_TAG)),
                       lambda t: _check_tag(t) is None),
}


@pytest.fixture(scope="module")
def kind_results(engine: LLMEngine) -> dict[str, list[Completion]]:
    names = list(KINDS)
    params = [p for name in names for p in (
        SamplingParams(temperature=0.0, n=2, max_tokens=60, structured=KINDS[name][0]),
        SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=60, structured=KINDS[name][0]))]
    results = run(engine, [PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    return {name: results[2 * i: 2 * i + 2] for i, name in enumerate(names)}


@pytest.mark.parametrize("name", KINDS)
def test_other_kinds_match(kind_results, name: str) -> None:
    check = KINDS[name][1]
    for result in kind_results[name]:
        for sample in samples(result):
            assert sample.finish_reason == "stop", sample.text
            assert check(sample.text), sample.text


def test_real_model_answers_in_shape(default_model_dir: Path) -> None:
    """The real model, asked in a chat: json_object gives an object, a schema a valid one with the
    right answer, a choice one of its words; greedy, so the text is the model's own best answer."""
    real = make_engine(default_model_dir, kv_cache_memory="64MiB")
    question = [{"role": "user",
                 "content": "What is the capital of France? Reply in JSON with keys country and capital."}]
    schema = {"type": "object", "required": ["country", "capital"],
              "properties": {"country": {"type": "string", "maxLength": 20},
                             "capital": {"type": "string", "maxLength": 20}}}
    yes_no = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    results = run(real, [question, question, yes_no], [
        SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput("json_object")),
        SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput.json_schema(schema)),
        SamplingParams(temperature=0, max_tokens=5, structured=StructuredOutput.choice(["Yes", "No"])),
    ])
    assert all(r.samples[0].finish_reason == "stop" for r in results), [r.text for r in results]
    assert isinstance(json.loads(results[0].text), dict)
    answer = json.loads(results[1].text)
    jsonschema.validate(answer, schema)
    assert answer["capital"] == "Paris"
    assert results[2].text in ("Yes", "No")


# ---- 3. the compile cache -----------------------------------------------------------------------

def test_same_spec_compiles_once(engine: LLMEngine) -> None:
    spec = StructuredOutput("regex", "[0-9]{4}-cache-test")
    compiles = engine.grammars.compiles
    engine.make_request("hi", SamplingParams(structured=spec))
    assert engine.grammars.compiles == compiles + 1
    # The same spec from another field is the same grammar: param names the field, not the spec.
    same = StructuredOutput(spec.kind, spec.spec, "guided_regex")
    engine.make_request("hello", SamplingParams(structured=same))
    assert engine.grammars.compiles == compiles + 1 and engine.grammars.compile(same) is engine.grammars.compile(spec)
    other = StructuredOutput("regex", "[0-9]{5}-cache-test")
    engine.make_request("hi", SamplingParams(structured=other))
    assert engine.grammars.compiles == compiles + 2
    assert engine.grammars.compile(other) is not engine.grammars.compile(spec)
    assert not engine.has_unfinished()  # make_request queues nothing


def test_cache_evicts_least_recently_used(engine: LLMEngine) -> None:
    compiler = GrammarCompiler(engine.grammars.info, cache_size=2)
    a, b, c = (StructuredOutput.choice([word]) for word in ("a", "b", "c"))
    first_a = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is first_a and compiler.compiles == 2  # a is now the most recent
    compiler.compile(c)  # evicts b, the least recently used
    assert compiler.compiles == 3
    assert compiler.compile(a) is first_a and compiler.compiles == 3
    compiler.compile(b)
    assert compiler.compiles == 4
    assert compiler.compile_seconds > 0


# ---- 4. bad specs -------------------------------------------------------------------------------

BAD_SPECS = {
    "not_json": StructuredOutput("json", "{not json", "response_format"),
    "unsupported_type": StructuredOutput.json_schema({"type": "frobnicate"}, "response_format"),
    "dangling_ref": StructuredOutput.json_schema({"$ref": "#/$defs/missing"}, "response_format"),
    "empty_range": StructuredOutput.json_schema({"type": "integer", "minimum": 5, "maximum": 1}, "guided_json"),
    "schema_not_object": StructuredOutput("json", "[1, 2]", "guided_json"),
    "bad_regex": StructuredOutput("regex", "[a-z", "guided_regex"),
    "unclosed_group": StructuredOutput("regex", "(abc", "guided_regex"),
    "bad_ebnf": StructuredOutput("grammar", "root ::= missing_rule", "guided_grammar"),
    "not_a_grammar": StructuredOutput("grammar", "this is not a grammar", "guided_grammar"),
    "empty_choices": StructuredOutput.choice([]),
    "choices_not_strings": StructuredOutput("choice", "[1, 2]", "guided_choice"),
    "bad_structural_tag": StructuredOutput("structural_tag", '{"type": "structural_tag", "format": {"type": "no"}}',
                                           "response_format"),
    "unknown_kind": StructuredOutput("xml", "<a/>", "response_format"),
}


@pytest.mark.parametrize("name", BAD_SPECS)
def test_bad_spec_raises_naming_its_param(engine: LLMEngine, name: str) -> None:
    spec = BAD_SPECS[name]
    compiles = engine.grammars.compiles
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request("Hello", SamplingParams(structured=spec))
    assert e.value.param == spec.param
    assert engine.grammars.compiles == compiles
    assert not engine.has_unfinished() and not engine.scheduler.waiting


def test_engine_serves_after_bad_specs(engine: LLMEngine) -> None:
    for spec in BAD_SPECS.values():
        with pytest.raises(InvalidRequestError):
            engine.add_request("Hello", SamplingParams(structured=spec))
    assert not engine.has_unfinished()
    free, constrained = run(engine, ["Hello", "Hello"], [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, structured=REGEX)])
    assert len(free.token_ids) == 5
    assert KINDS["regex"][1](constrained.text) and constrained.samples[0].finish_reason == "stop"


def test_structured_output_needs_a_tokenizer() -> None:
    bare = LLMEngine(EngineConfig(model="random:tiny-llama3", device="cpu"))
    assert bare.tokenizer is None and bare.grammars is None
    with pytest.raises(InvalidRequestError) as e:
        bare.make_request([1, 2, 3], SamplingParams(structured=StructuredOutput("regex", "a", "guided_regex")))
    assert e.value.param == "guided_regex"


# ---- 5. EOS only where the grammar can end ------------------------------------------------------

CHOICES = ["no", "not sure", "yes"]


def test_eos_only_where_the_grammar_can_end(engine: LLMEngine) -> None:
    eos = min(engine.eos_token_ids)
    bang = engine.tokenizer.encode("!", add_special_tokens=False)[0]
    grammar = StructuredOutput.choice(CHOICES)
    eager_eos = {eos: 100.0}  # EOS first wherever the mask lets it through
    cases = [
        dict(logit_bias=eager_eos),
        dict(logit_bias=eager_eos, ignore_eos=True),
        dict(ignore_eos=True),
        dict(logit_bias={bang: 100.0}, stop_token_ids=[bang]),  # a stop token the grammar never allows
        dict(logit_bias={bang: 100.0}, stop_token_ids=[bang], ignore_eos=True),
    ]
    params = [SamplingParams(temperature=t, seed=s, n=2, max_tokens=30, structured=grammar, **case)
              for case in cases for t, s in ((0.0, None), (1.0, 3), (1.5, 4))]
    for result in run(engine, PROMPTS[:1] * len(params), params):
        for sample in samples(result):
            assert sample.text in CHOICES and sample.finish_reason == "stop", sample
            assert sample.token_ids[-1] in engine.eos_token_ids  # the grammar ended on EOS
    # Without the grammar the same biases end (or would end) at once: the mask is what held them back.
    unconstrained = run(engine, ["Hello", "Hello"], [
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, logit_bias=eager_eos),
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, logit_bias={bang: 100.0}, stop_token_ids=[bang])])
    assert unconstrained[0].token_ids == [eos] and unconstrained[1].token_ids == [bang]




def test_choice_with_characters_outside_the_bmp(engine: LLMEngine) -> None:
    choices = ["party 🎉", "café", 'say "hi"\\n']
    compiled = engine.grammars.compile(StructuredOutput.choice(choices))
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    params = SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=30, structured=StructuredOutput.choice(choices))
    [result] = run(engine, ["Hello"], [params])
    assert all(s.text in choices and s.finish_reason == "stop" for s in samples(result))


# ---- 6. constrained and free requests in one batch ----------------------------------------------



def test_a_constrained_neighbour_leaves_a_seeded_request_alone(engine: LLMEngine) -> None:
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    [alone] = run(engine, ["Hello there"], [free])
    mixed, constrained = run(engine, ["Hello there", "Tell me"],
                             [free, SamplingParams(temperature=0.0, max_tokens=20, structured=REGEX)])
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", constrained.text)
    assert mixed.token_ids == alone.token_ids


def test_penalties_apply_under_a_grammar(tiny_dir: Path, default_model_dir: Path) -> None:
    own = make_engine(tiny_dir, default_model_dir)  # its own: the bug leaves an engine mid-step
    penalties = [dict(presence_penalty=1.5), dict(frequency_penalty=1.5), dict(repetition_penalty=1.5)]
    params = [SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=20, structured=REGEX, **p) for p in penalties]
    for result in run(own, PROMPTS[:3], params):
        for sample in samples(result):
            assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", sample.text) and sample.finish_reason == "stop"


SMALL_SCHEMA = {"type": "object", "required": ["id"],
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                               "tag": {"enum": ["a", "bb"]}, "ok": {"type": "boolean"}}}
MIX_GRAMMARS = {
    "regex": KINDS["regex"],
    "choice": KINDS["choice"],
    "schema": (StructuredOutput.json_schema(SMALL_SCHEMA),
               lambda t: jsonschema.validate(json.loads(t), SMALL_SCHEMA) is None),
}
ALL_PROMPTS = PROMPTS + [LONG_PROMPT]

free_requests = st.builds(
    lambda prompt, temperature, seed, n, max_tokens, penalty: (
        prompt, SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=max_tokens, ignore_eos=True,
                               presence_penalty=penalty)),
    st.sampled_from(ALL_PROMPTS), st.sampled_from([0.0, 0.7, 1.0, 1.5]), st.integers(0, 2**31),
    st.integers(1, 2), st.integers(1, 12), st.sampled_from([0.0, 0.0, 0.5]))
constrained_requests = st.builds(
    lambda prompt, grammar, temperature, seed, n, penalty: (
        prompt, SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=40, presence_penalty=penalty,
                               structured=MIX_GRAMMARS[grammar][0]), grammar),
    st.sampled_from(ALL_PROMPTS), st.sampled_from(sorted(MIX_GRAMMARS)), st.sampled_from([0.0, 1.0, 1.3]),
    st.integers(0, 2**31), st.integers(1, 2), st.sampled_from([0.0, 0.0, 0.5]))


@st.composite
def mixes(draw) -> tuple[list, list, list[int]]:
    free = draw(st.lists(free_requests, min_size=1, max_size=3))
    constrained = draw(st.lists(constrained_requests, min_size=1, max_size=3))
    order = draw(st.permutations(range(len(free) + len(constrained))))
    return free, constrained, order


# Enough at once to overflow the tight engine's eight blocks, whatever hypothesis draws.
BIG_MIX = (
    [(LONG_PROMPT, SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=12, ignore_eos=True)),
     (PROMPTS[1], SamplingParams(temperature=0.0, n=2, max_tokens=12, ignore_eos=True))],
    [(LONG_PROMPT, SamplingParams(temperature=1.0, seed=6, n=2, max_tokens=40, structured=MIX_GRAMMARS["schema"][0]),
      "schema"),
     (PROMPTS[0], SamplingParams(temperature=0.0, n=2, max_tokens=40, structured=REGEX), "regex")],
    [2, 0, 3, 1])


@pytest.mark.parametrize("which", ["plain", "tight"])
def test_grammars_do_not_change_free_requests(mix_engines, which: str) -> None:
    """Free seeded requests give the same tokens beside any mix of constrained ones as alone, and the
    constrained ones still match; on the tight engine through preemption and chunked prefill too."""
    engine = mix_engines[which]
    preemptions = engine.stats().preemptions

    @settings(max_examples=8, deadline=None)
    @given(mixes())
    @example(BIG_MIX)
    def check(mix: tuple[list, list, list[int]]) -> None:
        free, constrained, order = mix
        alone = run(engine, [p for p, _ in free], [sp for _, sp in free])
        everything = free + [(p, sp) for p, sp, _ in constrained]
        mixed = run(engine, [everything[i][0] for i in order], [everything[i][1] for i in order])
        by_index = dict(zip(order, mixed))
        for i, reference in enumerate(alone):
            assert [s.token_ids for s in samples(by_index[i])] == [s.token_ids for s in samples(reference)]
        for j, (_, _, grammar) in enumerate(constrained):
            for sample in samples(by_index[len(free) + j]):
                assert sample.finish_reason == "stop" and MIX_GRAMMARS[grammar][1](sample.text), sample

    check()
    if which == "tight":
        assert engine.stats().preemptions > preemptions


# ---- 7. random JSON schemas ---------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "id", "name", "x_y"])
leaves = st.one_of(
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.tuples(st.integers(-20, 20), st.integers(1, 40)).map(
        lambda t: {"type": "number", "minimum": t[0] / 4, "maximum": (t[0] + t[1]) / 4}),
    st.just({"type": "boolean"}),
    st.lists(st.text("abcxyz ", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}),
)


def _array(items: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(items, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]})


@st.composite
def _object(draw, values: st.SearchStrategy) -> dict:
    properties = draw(st.dictionaries(NAMES, values, min_size=1, max_size=3))
    required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True))
    return {"type": "object", "properties": properties, "required": required}


schemas = _object(st.recursive(leaves | _array(leaves), lambda inner: _object(inner) | _array(inner), max_leaves=4))


@pytest.mark.parametrize("kind", ["json", "structural_tag"])
def test_bounded_strings_refuse_raw_control_characters(engine: LLMEngine, kind: str) -> None:
    """JSON strings never hold a raw control character, bounded (maxLength) or not, in a response
    format or in tool-call arguments (a structural tag): xgrammar's own bounded strings would take one."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}, "t": {"type": "string"}},
              "required": ["s", "t"]}
    spec = (StructuredOutput.json_schema(schema) if kind == "json" else StructuredOutput(
        "structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}),
        "tools"))
    compiled = engine.grammars.compile(spec)
    for text in ('{"s": "a\x15', '{"s": "a", "t": "\x15', '{"s": "a\n'):
        assert not xgr.GrammarMatcher(compiled).accept_string(text), text
    assert xgr.GrammarMatcher(compiled).accept_string('{"s": "a b", "t": "c\\u0015"}')


def test_random_schemas_validate(engine: LLMEngine) -> None:
    @settings(max_examples=8, deadline=None)
    @given(schemas, st.integers(0, 2**31))
    def check(schema: dict, seed: int) -> None:
        spec = StructuredOutput.json_schema(schema)
        results = run(engine, ["Hello", "The weather today is"], [
            SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=150, structured=spec),
            SamplingParams(temperature=0.0, max_tokens=150, structured=spec)])
        for result in results:
            for sample in samples(result):
                assert sample.finish_reason == "stop", (schema, sample.text)
                jsonschema.validate(json.loads(sample.text), schema)

    check()


# ---- 8. the sampler's mask ----------------------------------------------------------------------

def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """[R, V] bool -> [R, ceil(V/32)] int32, bit v % 32 of word v // 32 (xgrammar's layout)."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, (vocab + 31) // 32 * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def batch_mask(batch: int, allowed: dict[int, torch.Tensor], vocab: int) -> torch.Tensor:
    """The batch's bitmask: row r's bits from allowed[r] ([V] bool), every bit set in the other rows."""
    words = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    for row, bits in allowed.items():
        words[row] = pack_bits(bits.unsqueeze(0))[0]
    return words


@pytest.mark.parametrize("vocab", [32, 37, 100, 1000])
def test_apply_token_mask_touches_only_the_named_rows(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    before = logits.clone()
    rows = [3, 0]
    allowed = torch.rand(len(rows), vocab, generator=gen) < 0.3
    allowed[:, -1] = True  # the last id, in the padded word, is reachable
    allowed[0, 31 % vocab] = True  # bit 31: the int32 sign bit
    masked = apply_token_mask(logits, batch_mask(5, dict(zip(rows, allowed)), vocab))
    assert torch.equal(logits, before)  # out of place
    for k, r in enumerate(rows):
        assert torch.equal(masked[r][allowed[k]], logits[r][allowed[k]])
        assert torch.all(masked[r][~allowed[k]] == float("-inf"))
    for r in (1, 2, 4):
        assert torch.equal(masked[r], logits[r])
    assert apply_token_mask(logits, None) is logits
    assert torch.equal(apply_token_mask(logits, batch_mask(5, {}, vocab)), logits)


def test_masked_greedy_row_takes_the_best_allowed_token() -> None:
    vocab = 70
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, [5, 40, 69]] = True
    best = max((5, 40, 69), key=lambda v: logits[1, v].item())
    assert logits[1].argmax().item() != best  # the mask must change the pick
    greedy = [SampleRow(SamplingParams(temperature=0.0), 0, 0, [], []) for _ in range(3)]
    out = Sampler()(logits, greedy, batch_mask(3, {1: allowed[0]}, vocab))
    assert out.token_id_list == [logits[0].argmax().item(), best, logits[2].argmax().item()]
    sampled = [SampleRow(SamplingParams(temperature=1.0), seed, 0, [], []) for seed in range(3)]
    for seed in range(20):  # a sampled row, whatever its noise, stays inside the mask
        sampled[1].seed = seed
        assert Sampler()(logits, sampled, batch_mask(3, {1: allowed[0]}, vocab)).token_id_list[1] in (5, 40, 69)


@pytest.mark.parametrize("processes", [1, 2])
def test_worker_masks_match_xgrammar(engine: LLMEngine, processes: int) -> None:
    """The grammar worker's masks (other processes, shared memory) are what a matcher here fills,
    row for row, after the same tokens; apply_token_mask reads them as xgrammar means them. Split
    in two, each process fills its own rows and leaves the other's."""
    spec = StructuredOutput.choice(["yes", "no"])
    vocab = engine.sample_vocab_size
    yes = engine.tokenizer.encode("yes", add_special_tokens=False)[0]
    worker = GrammarWorker(engine.grammars.info, processes=processes)
    try:
        grammars = [(1, worker.grammar(spec)), (2, worker.grammar(spec))]  # keys 0 and 1: one per process
        other = engine.tokenizer.encode("no", add_special_tokens=False)[0]
        worker.submit([-1, -1, grammars[1][1].key])  # only row 2 is filled: only it takes its token
        worker.masks()
        worker.accept([other, other, yes])
        worker.submit([-1] + [g.key for _, g in grammars])
        mask = worker.masks()
        assert mask.shape[0] == 3 and torch.all(mask[0] == -1)  # row 0 has no grammar: all allowed
        for row, tokens in ((1, []), (2, [yes])):  # the same matcher, here, after the same tokens
            matcher = xgr.GrammarMatcher(engine.grammars.compile(spec))
            assert all(matcher.accept_token(t) for t in tokens)
            alone = xgr.allocate_token_bitmask(1, vocab)
            matcher.fill_next_token_bitmask(alone)
            assert torch.equal(alone[0], mask[row])
        masked = apply_token_mask(torch.zeros(3, vocab), mask)
        for row, _ in grammars:
            expected = xgr.testing.bitmask_to_bool_mask(mask[row: row + 1], vocab)[0]
            assert torch.equal(masked[row] == 0, expected)
        first = set(torch.nonzero(masked[1] == 0).flatten().tolist())
        decoded = {engine.tokenizer.decode([t]) for t in first}
        assert decoded and all("yes".startswith(d) or "no".startswith(d) for d in decoded)
        assert set(torch.nonzero(masked[2] == 0).flatten().tolist()) <= set(engine.eos_token_ids)  # "yes" is done
        assert torch.equal(masked[0], torch.zeros(vocab))
        worker.accept([other, yes, yes])  # row 1 starts its "yes"; row 2 is done, so refuses it: that grammar ends
        worker.submit([-1, grammars[0][1].key, -1])
        worker.masks()
        assert not grammars[0][1].ended and grammars[1][1].ended
    finally:
        worker.close()



def test_worker_masks_each_draft_row_after_the_drafts_before_it(engine: LLMEngine) -> None:
    """A sequence with drafts has a row per draft: each is masked by its grammar after the drafts
    before it (rows after a draft it refuses allow every token), the matcher is rolled back after,
    and it then takes the sampled ids the engine keeps: the first row's, then each next row's while
    the row before sampled its draft. Split in two processes, each takes one of the sequences."""
    spec = StructuredOutput("regex", r"[xy]{6}")
    x, y, z = (engine.tokenizer.encode(t, add_special_tokens=False)[0] for t in "xyz")
    vocab = engine.sample_vocab_size
    worker = GrammarWorker(engine.grammars.info, processes=2)

    def expected(tokens: list[int]) -> torch.Tensor:
        matcher = xgr.GrammarMatcher(engine.grammars.compile(spec))
        assert all(matcher.accept_token(t) for t in tokens)
        alone = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(alone)
        return alone[0]

    try:
        a, b = worker.grammar(spec), worker.grammar(spec)  # keys 0 and 1: one per process when split
        worker.submit([a.key, a.key, a.key, a.key, b.key, -1], [-1, x, z, y, -1, -1])
        mask = worker.masks()
        assert torch.equal(mask[0], expected([])) and torch.equal(mask[1], expected([x]))
        assert torch.all(mask[2] == -1) and torch.all(mask[3] == -1)  # after z, which the grammar refuses
        assert torch.equal(mask[4], expected([])) and torch.all(mask[5] == -1)
        worker.accept([x, y, y, x, y, 0])  # a keeps x (row 1's draft) and y (row 1's sample), not row 2's
        worker.submit([a.key, b.key])
        mask = worker.masks()
        assert torch.equal(mask[0], expected([x, y])) and torch.equal(mask[1], expected([y]))
        assert not a.ended and not b.ended
    finally:
        worker.close()


def test_fills_split_between_two_processes_give_the_same_outputs(engine: LLMEngine) -> None:
    """A large batch's fills split by key between two worker processes: every request, constrained
    or not, samples exactly what one process gives it (so no row is left to the wrong process)."""
    names = list(KINDS)
    params = [SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=60, structured=KINDS[name][0])
              for i, name in enumerate(names)] + [SamplingParams(temperature=1.0, seed=5, max_tokens=20)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    one = run(engine, prompts, params)
    single, engine.grammar_worker = engine.grammar_worker, GrammarWorker(engine.grammars.info, processes=2)
    try:
        two = run(engine, prompts, params)
    finally:
        engine.grammar_worker.close()
        engine.grammar_worker = single
    assert [samples(r) for r in two] == [samples(r) for r in one]
    for name, result in zip(names, two):
        assert all(s.finish_reason == "stop" and KINDS[name][1](s.text) for s in samples(result))

@pytest.mark.parametrize("cores, max_num_seqs, processes", [(2, 256, 1), (4, 256, 2), (16, 256, 4), (16, 16, 1)])
def test_large_batches_split_their_fills_as_cores_allow(monkeypatch: pytest.MonkeyPatch, cores: int,
                                                        max_num_seqs: int, processes: int) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert worker_processes(max_num_seqs) == processes


def test_a_dead_grammar_worker_is_an_error_not_a_hang(engine: LLMEngine) -> None:
    """The engine thread waits on the worker's reply: if the worker dies, the wait ends in an error
    (the engine loop then fails every request) instead of blocking for ever."""
    worker = GrammarWorker(engine.grammars.info)
    try:
        worker.start()
        worker._processes[0].kill()
        worker._processes[0].join(10)
        with pytest.raises(GrammarWorkerError):
            worker.submit([worker.grammar(StructuredOutput.choice(["yes"])).key])
            worker.masks()
    finally:
        worker.close()


def test_stats_count_constrained_requests(engine: LLMEngine) -> None:
    before = engine.stats()
    run(engine, ["Hello"], [SamplingParams(max_tokens=3, ignore_eos=True)])
    assert engine.stats().constrained_requests == before.constrained_requests
    run(engine, ["Hello", "Hello", "Hello"], [
        SamplingParams(n=2, max_tokens=20, structured=KINDS["choice"][0]),
        SamplingParams(max_tokens=5, ignore_eos=True),
        SamplingParams(max_tokens=20, structured=REGEX)])
    after = engine.stats()
    assert after.constrained_requests == before.constrained_requests + 2
    assert after.grammar_mask_seconds > before.grammar_mask_seconds
