"""app/tools: each family's grammar (compiled by xgrammar on the SmolLM2 tokenizer) accepts well-formed
calls and rejects bad ones; its streaming parser gives the same content and calls however the output
is chunked, and turns malformed calls back into content; format_for picks the family of a template."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from app.tools import TOOL_FORMATS, ArgumentsDelta, ContentDelta, ToolCall, ToolCallStart, format_for
from engine.errors import InvalidRequestError
from engine.model_store import DEFAULT_DIR_NAME, is_complete, models_dir

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: takes {}
TOOLS = [WEATHER, TIME]

PARIS = ("get_weather", '{"city": "Paris", "unit": "c"}')
NOW = ("get_time", "{}")
# Strings holding every family's marker text, braces and escaped quotes, inside a valid call.
TRICKY = ("get_weather", json.dumps({"city": 'a}{"]<tool_call>[TOOL_CALLS]{"name": <|python_tag|></tool_call>'}))

# Each family's wire format written out by hand: (section begin, one call, separator, section end).
WIRES = {
    "hermes": ("", '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>', "\n", ""),
    "generic": ("", '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>', "\n", ""),
    "llama3": ("", '{"name": "%s", "parameters": %s}', "; ", ""),
    "mistral": ("[TOOL_CALLS][", '{"name": "%s", "arguments": %s}', ", ", "]"),
}
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
FORMATS = sorted(WIRES)


def output(fmt: str, *calls: tuple[str, str]) -> str:
    """A tool-call section of `calls` as family `fmt` writes it."""
    begin, call, sep, end = WIRES[fmt]
    return begin + sep.join(call % c for c in calls) + end


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest) -> Path:
    """The converted SmolLM2 (tokenizer and chat template): the cached one, else the suite's."""
    cached = models_dir() / DEFAULT_DIR_NAME
    return cached if is_complete(cached) else request.getfixturevalue("default_model_dir")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))


def matcher(compiler: xgr.GrammarCompiler, spec: str):
    """matches(text): the grammar accepts text as a whole reply (the model may end after it)."""
    compiled = compiler.compile_structural_tag(spec)

    def matches(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.is_completed()
    return matches


# ---- grammars

@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_allows_text_then_valid_calls_then_the_end(compiler, fmt: str, parallel: bool) -> None:
    matches = matcher(compiler, TOOL_FORMATS[fmt].grammar(TOOLS, "auto", parallel))
    assert matches("Just an answer, no tools.")
    assert matches("")
    assert matches(output(fmt, PARIS))
    assert matches("Let me look that up. " + output(fmt, PARIS))
    assert matches(output(fmt, NOW))
    assert matches(output(fmt, PARIS, NOW)) == parallel
    assert matches(output(fmt, TRICKY))
    assert matches(output(fmt, ("get_weather", '{\n"city": "Paris"}')))  # one whitespace character in a row
    assert not matches(output(fmt, ("get_weather", '{\n  "city":"Paris"\n}')))  # but no indents
    assert not matches(output(fmt, PARIS) + " and then more text")  # after the calls, only the end
    assert not matches(output(fmt, ("get_stock", "{}")))  # unknown tool
    assert not matches(output(fmt, ("get_weather", '{"city": 3}')))  # wrong type
    assert not matches(output(fmt, ("get_weather", '{"unit": "c"}')))  # missing required
    assert not matches(output(fmt, ("get_weather", '{"city": "Paris", "unit": "k"}')))  # not in the enum
    assert not matches(output(fmt, ("get_weather", '{"city": "Paris", "zip": 1}')))  # unknown property
    assert not matches(output(fmt, ("get_time", '{"x": 1}')))  # no parameters means none


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_required_needs_a_call_from_the_start(compiler, fmt: str, parallel: bool) -> None:
    matches = matcher(compiler, TOOL_FORMATS[fmt].grammar(TOOLS, "required", parallel))
    assert matches(output(fmt, PARIS))
    assert matches(output(fmt, NOW, PARIS)) == parallel
    assert not matches("Just an answer, no tools.")
    assert not matches("")
    assert not matches("Sure. " + output(fmt, PARIS))
    assert not matches(output(fmt, ("get_weather", '{"city": null}')))
    assert not matches(output(fmt, ("get_stock", "{}")))


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_named_tool_forces_exactly_that_one_call(compiler, fmt: str, parallel: bool) -> None:
    for choice in ("get_weather", {"type": "function", "function": {"name": "get_weather"}}):
        matches = matcher(compiler, TOOL_FORMATS[fmt].grammar(TOOLS, choice, parallel))
        assert matches(output(fmt, PARIS))
        assert not matches(output(fmt, NOW))
        assert not matches(output(fmt, PARIS, PARIS))
        assert not matches("Sure. " + output(fmt, PARIS))
        assert not matches(output(fmt, ("get_weather", "{}")))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_tokens_of_a_reply_pass_the_mask_and_may_stop(tokenizer, compiler, fmt: str) -> None:
    """Token by token, as the engine feeds it: each token of a well-formed reply is allowed, then the stop token."""
    compiled = compiler.compile_structural_tag(TOOL_FORMATS[fmt].grammar(TOOLS, "auto", True))
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    for token in tokenizer.encode("Let me see. " + output(fmt, PARIS, NOW), add_special_tokens=False):
        matcher.fill_next_token_bitmask(mask)
        assert mask[0, token // 32] >> (token % 32) & 1
        assert matcher.accept_token(token)
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


def test_bad_tool_choices_are_request_errors(compiler) -> None:
    fmt = TOOL_FORMATS["hermes"]
    with pytest.raises(InvalidRequestError, match="get_stock") as e:
        fmt.grammar(TOOLS, "get_stock")
    assert e.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError):
        fmt.grammar([], "required")
    with pytest.raises(ValueError, match="none"):
        fmt.grammar(TOOLS, "none")
    assert matcher(compiler, fmt.grammar([], "auto"))("<tool_call> anything")  # no tools: no constraint


# ---- parsing

def parse(fmt: str, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed chunks; check the events agree with parser.calls; return (content, [(name, arguments)])."""
    parser = TOOL_FORMATS[fmt].parser()
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    started = {e.index: e for e in events if isinstance(e, ToolCallStart)}
    arguments = {i: "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == i) for i in started}
    calls = parser.calls
    assert all(isinstance(c, ToolCall) and c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    by_id = {s.id: (s.name, arguments[i]) for i, s in started.items()}
    assert [(c.name, c.arguments) for c in calls] == [by_id[c.id] for c in calls]
    return content, [(c.name, c.arguments) for c in calls]


def samples(fmt: str) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(output, its content, its calls) for one family."""
    return [
        ("Hello there.", "Hello there.", []),
        ("a < b, [x] {y} and a ; c\n", "a < b, [x] {y} and a ; c\n", []),  # trigger-like text stays content
        (output(fmt, PARIS), "", [PARIS]),
        ("Let me check.\n\n" + output(fmt, PARIS) + "\n", "Let me check.", [PARIS]),
        (output(fmt, PARIS, NOW), "", [PARIS, NOW]),
        (output(fmt, TRICKY, NOW, PARIS), "", [TRICKY, NOW, PARIS]),
        (output(fmt, ("get_weather", '{\n  "city":  "Paris"\n}')), "", [("get_weather", '{\n  "city":  "Paris"\n}')]),
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_parse_whole_and_char_by_char(fmt: str) -> None:
    for text, content, calls in samples(fmt):
        assert parse(fmt, [text]) == (content, calls), text
        assert parse(fmt, list(text)) == (content, calls), text


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_parse_any_chunking(fmt: str, data: st.DataObject) -> None:
    text, content, calls = data.draw(st.sampled_from(samples(fmt)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert parse(fmt, chunks) == (content, calls)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_name_is_announced_before_the_arguments_end(fmt: str) -> None:
    text = "Checking. " + output(fmt, PARIS)
    parser = TOOL_FORMATS[fmt].parser()
    cut = text.index('"city"')
    first = parser.feed(text[:cut])
    assert [type(e) for e in first] == [ContentDelta, ToolCallStart, ArgumentsDelta]
    assert first[1].name == "get_weather" and first[2].text == "{"
    assert [e.text for e in parser.feed(text[cut:]) + parser.finish()] == ['"city": "Paris", "unit": "c"}']


@pytest.mark.parametrize("fmt", FORMATS)
def test_malformed_calls_become_content(fmt: str) -> None:
    whole = output(fmt, PARIS)
    broken = [
        output(fmt, ("", "{}")),  # no name
        whole.replace('"arguments"', '"args"').replace('"parameters"', '"args"'),
    ]
    for text in broken:
        assert parse(fmt, [text]) == (text, []), text
        assert parse(fmt, list(text)) == (text, []), text


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_started_call_is_never_taken_back(fmt: str) -> None:
    """Once its name is out, a call stays a call: cut short by max_tokens it keeps the arguments it
    got (as the stream already sent them), and no markup turns into content."""
    whole = output(fmt, PARIS)
    cut = whole[:-len(whole) // 3]
    for chunks in ([cut], list(cut)):
        content, calls = parse(fmt, chunks)
        assert content == "" and len(calls) == 1 and calls[0][0] == "get_weather", (content, calls)
        assert PARIS[1].startswith(calls[0][1])
    loose = output(fmt, ("get_weather", '{"city": Paris}'))  # only a grammar makes arguments valid JSON
    assert parse(fmt, [loose]) == ("", [("get_weather", '{"city": Paris}')])


@pytest.mark.parametrize("fmt", FORMATS)
def test_render_calls_parses_back(fmt: str) -> None:
    calls = [PARIS, NOW]
    text = TOOL_FORMATS[fmt].render_calls([{"function": {"name": n, "arguments": a}} for n, a in calls])
    assert text == output(fmt, *calls)
    assert parse(fmt, [text]) == ("", calls)


def test_mistral_takes_a_call_without_a_list_and_llama_a_python_tag() -> None:
    assert parse("mistral", ['[TOOL_CALLS] {"name": "get_time", "arguments": {}}']) == ("", [NOW])
    text = 'Now: <|python_tag|>{"name": "get_time", "parameters": {}}\n<|python_tag|>' + output("llama3", PARIS)
    assert parse("llama3", [text]) == ("Now:", [NOW, PARIS])


FRAGMENTS = [output("hermes", NOW), output("llama3", TRICKY), output("mistral", PARIS),
             "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '{"name": ', '"get_time"', ", ",
             '"arguments": ', '"parameters": ', "{", "}", "[", "]", '"', "\\", "\n", " ", ";", "x", "<", "tool"]


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_output_parses_without_raising(fmt: str, data: st.DataObject) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=25)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    content, calls = parse(fmt, chunks)
    assert (content, calls) == parse(fmt, [text])
    if not calls:
        assert content == text  # nothing lost, nothing added
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_and_parser_agree(compiler, fmt: str) -> None:
    """Every reply the auto grammar accepts parses to its calls, with no marker text in the content."""
    matches = matcher(compiler, TOOL_FORMATS[fmt].grammar(TOOLS, "auto", True))
    for text, content, calls in samples(fmt):
        if matches(text):
            assert parse(fmt, [text]) == (content, calls)
            if calls:
                assert not any(m in content for m in MARKERS)


# ---- detection and prompts

HERMES_TEMPLATE = ('{%- if tools %}{{- "<tools>" }}{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}'
                   '{{- "</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call>" }}')
MISTRAL_TEMPLATE = '{{- "[AVAILABLE_TOOLS] [" }}{%- for tool in tools %}...{%- endfor %}{{- "[TOOL_CALLS] [" }}'
LLAMA31_TEMPLATE = ('{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}'
                    '{%- endif %}{{- "<|python_tag|>" + tool_call.name }}{{- "<|eom_id|>" }}')
LLAMA32_TEMPLATE = ('{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument '
                    'name and its value}.\' }}')


def test_format_for_detects_the_family() -> None:
    assert format_for(HERMES_TEMPLATE).name == "hermes"
    assert format_for(MISTRAL_TEMPLATE).name == "mistral"
    assert format_for(LLAMA31_TEMPLATE).name == "llama3"
    assert format_for(LLAMA32_TEMPLATE).name == "llama3"
    assert format_for(LLAMA31_TEMPLATE + HERMES_TEMPLATE).name == "hermes"  # hermes is tried first
    assert format_for("{{ messages }}").name == "generic"
    assert format_for(None).name == "generic"


def test_the_embedded_template_gets_generic(model_dir: Path) -> None:
    assert format_for((model_dir / "chat_template.jinja").read_text()).name == "generic"


def test_override_wins_and_unknown_names_list_the_valid_ones() -> None:
    assert format_for(HERMES_TEMPLATE, override="mistral").name == "mistral"
    with pytest.raises(ValueError, match="hermes, mistral, llama3, generic"):
        format_for(HERMES_TEMPLATE, override="qwen")


def test_generic_system_prompt_describes_tools_and_choice() -> None:
    generic = TOOL_FORMATS["generic"]
    prompt = generic.system_prompt(TOOLS, "auto")
    for text in ("get_weather", "The current weather in a city.", json.dumps(WEATHER["function"]["parameters"]),
                 "get_time", '{"type": "object", "properties": {}}', "<tool_call>", "</tool_call>"):
        assert text in prompt
    assert "must call the tool get_time" in generic.system_prompt(TOOLS, "get_time")
    assert "at least one" in generic.system_prompt(TOOLS, "required")
    assert all(TOOL_FORMATS[f].system_prompt(TOOLS, "auto") is None for f in ("hermes", "llama3", "mistral"))
