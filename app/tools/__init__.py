"""OpenAI tool calling: one module per model family's call format, registered by name.

Each ToolFormat builds the xgrammar structural tag that constrains a reply for a tools list and
tool_choice, parses the reply (streamed) into content and tool calls, and, for templates that know
no tools (generic), writes the system prompt describing them.
"""
from __future__ import annotations

from app.tools.base import ArgumentsDelta, ContentDelta, Event, ToolCall, ToolCallStart, WireFormat
from app.tools.format import ToolFormat
from app.tools.generic import GenericFormat
from app.tools.hermes import HermesFormat
from app.tools.llama3 import Llama3Format
from app.tools.mistral import MistralFormat
from app.tools.parser import ToolCallParser

TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), MistralFormat(), Llama3Format(),
                                                           GenericFormat())}
DETECTION_ORDER = ("hermes", "mistral", "llama3")  # generic when none matches


def format_for(chat_template: str | None, override: str | None = None) -> ToolFormat:
    """The tool format to use: `override` (--tool-call-parser) if given, else the first of
    DETECTION_ORDER whose detect() matches the chat template, else generic."""
    if override is not None:
        if override not in TOOL_FORMATS:
            raise ValueError(f"unknown tool call parser {override!r}; valid: {', '.join(TOOL_FORMATS)}")
        return TOOL_FORMATS[override]
    for name in DETECTION_ORDER:
        if chat_template and TOOL_FORMATS[name].detect(chat_template):
            return TOOL_FORMATS[name]
    return TOOL_FORMATS["generic"]


__all__ = ["TOOL_FORMATS", "ArgumentsDelta", "ContentDelta", "Event", "ToolCall", "ToolCallParser", "ToolCallStart",
           "ToolFormat", "WireFormat", "format_for"]
