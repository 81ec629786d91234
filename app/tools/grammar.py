"""The xgrammar structural tag that constrains a reply to a family's tool-call wire format.

Shapes, by tool_choice (S is a tool-call section: one call, or with parallel calls one or more
joined by the family's separator):
    "auto"      free text without the trigger, then optionally S, then the end of output
    "required"  S from the first character (no text before the calls)
    a name      exactly one call of that tool, from the first character
Each call's arguments must validate against its tool's parameters schema (strict or not; properties
in the schema's order, no extra properties), with at most MAX_WHITESPACE whitespace characters in
a row between JSON tokens. The text around the arguments is fixed: '{"name": "NAME", "arguments": '.
"""
from __future__ import annotations

import json

from xgrammar.structural_tag import (AnyTextFormat, ConstStringFormat, Format, JSONSchemaFormat, OptionalFormat,
                                     OrFormat, SequenceFormat, StarFormat, StructuralTag, TagFormat)

from app.tools.base import WireFormat, tool_name, tool_parameters
from engine.errors import InvalidRequestError

# One space after ':' and ',' at most: arguments stay on one line, so a small model can neither loop on
# newlines and indents nor spend its tokens on them.
MAX_WHITESPACE = 1


def chosen_tools(tools: list[dict], tool_choice: str | dict | None) -> tuple[list[dict], str]:
    """The tools the reply may call and the mode ("auto", "required" or "forced") of a tool_choice:
    "auto", "required", a function name, or OpenAI's {"type": "function", "function": {"name"}}."""
    if tool_choice is None:  # OpenAI's default when tools are given
        tool_choice = "auto"
    if tool_choice == "none":
        raise ValueError('tool_choice "none" is not constrained: do not build a grammar for it')
    if isinstance(tool_choice, dict):
        tool_choice = tool_choice["function"]["name"]
        forced = True
    else:
        forced = tool_choice not in ("auto", "required")
    if not forced:
        if tool_choice == "required" and not tools:
            raise InvalidRequestError('tool_choice "required" needs at least one tool', param="tool_choice")
        return tools, tool_choice
    named = [t for t in tools if tool_name(t) == tool_choice]
    if not named:
        raise InvalidRequestError(f"tool_choice names function {tool_choice!r}, which is not in tools",
                                  param="tool_choice")
    return named[:1], "forced"


def structural_tag(wire: WireFormat, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool) -> str:
    """The structural tag JSON (for xgrammar's compile_structural_tag) of a reply that may or must
    call `tools` as `tool_choice` says, in `wire`'s format."""
    allowed, mode = chosen_tools(tools, tool_choice)
    if not allowed:  # "auto" with no tools: nothing to constrain
        return StructuralTag(format=AnyTextFormat()).model_dump_json()
    section = _section(wire, allowed, parallel_tool_calls and mode != "forced")
    if mode == "auto":
        section = SequenceFormat(elements=[AnyTextFormat(excludes=[wire.trigger]), OptionalFormat(content=section)])
    return StructuralTag(format=section).model_dump_json()


def _call(wire: WireFormat, tool: dict) -> TagFormat:
    head = f'{wire.call_begin}{{"name": {json.dumps(tool_name(tool))}, {json.dumps(wire.args_key)}: '
    arguments = JSONSchemaFormat(json_schema=tool_parameters(tool), max_whitespace_cnt=MAX_WHITESPACE)
    return TagFormat(begin=head, content=arguments, end="}" + wire.call_end)


def _section(wire: WireFormat, tools: list[dict], parallel: bool) -> Format:
    calls = [_call(wire, t) for t in tools]
    call: Format = calls[0] if len(calls) == 1 else OrFormat(elements=calls)
    if parallel:
        more = StarFormat(content=SequenceFormat(elements=[ConstStringFormat(value=wire.separator), call]))
        call = SequenceFormat(elements=[call, more])
    parts = [ConstStringFormat(value=wire.section_begin)] if wire.section_begin else []
    parts.append(call)
    if wire.section_end:
        parts.append(ConstStringFormat(value=wire.section_end))
    return parts[0] if len(parts) == 1 else SequenceFormat(elements=parts)
