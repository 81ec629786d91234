"""What tool calling passes around: a parsed call, the streaming events of a choice's output, and
the wire format of a model family's calls (one `WireFormat` drives both its grammar and its parser).

Every family here writes a call as a JSON object `{"name": NAME, "<args_key>": {...}}` wrapped in
family-specific marker text; they differ only in that text, so a family is data, not code.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: a tool without parameters takes none


@dataclass
class ToolCall:
    """One tool call. `arguments` is the arguments object's JSON text exactly as the model wrote it
    (its own whitespace kept), which is also the join of the call's ArgumentsDeltas; cut short by
    max_tokens (finish_reason "length"), it is what the model got to write."""

    id: str
    name: str
    arguments: str


@dataclass
class ContentDelta:
    """Text of the reply outside any tool call."""

    text: str


@dataclass
class ToolCallStart:
    """The first event of call #index: its name is complete."""

    index: int
    id: str
    name: str


@dataclass
class ArgumentsDelta:
    """A fragment of call #index's arguments JSON text."""

    index: int
    text: str


Event = ContentDelta | ToolCallStart | ArgumentsDelta


@dataclass(frozen=True)
class WireFormat:
    """How one family writes tool calls. A whole tool-call section is

        section = section_begin call (separator call)* section_end
        call    = call_begin {"name": NAME, "<args_key>": ARGS} call_end

    and `trigger` is the text that opens it inside free text (a prefix of section_begin + call_begin
    + '{"name": '). The other fields tell the parser what to accept, which is looser than what the
    grammar allows, for output that was not constrained."""

    trigger: str
    call_begin: str = ""
    call_end: str = ""
    args_key: str = "arguments"
    separator: str = "\n"
    section_begin: str = ""
    section_end: str = ""
    # Parser: marker strings consumed before a call object (e.g. "<tool_call>").
    markers: tuple[str, ...] = ()
    # Parser: strings that start a call object in free text without a marker (e.g. '{"name"').
    json_starts: tuple[str, ...] = ()
    # Parser: whether a marker may open a JSON list of call objects ("[TOOL_CALLS][{...}, {...}]").
    list_calls: bool = False
    # Parser: a marker that may close each call (e.g. "</tool_call>"), dropped if present.
    call_close: str = ""
    # Parser: characters besides whitespace that may separate calls (dropped between calls).
    separators: str = ""


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id: "call_" and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def tool_name(tool: dict) -> str:
    """The function name of an OpenAI tool dict {"type": "function", "function": {"name", ...}}."""
    return tool["function"]["name"]


def tool_parameters(tool: dict) -> dict:
    """The JSON schema of a tool's arguments (no parameters: an empty object)."""
    return tool["function"].get("parameters") or EMPTY_PARAMETERS
