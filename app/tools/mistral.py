"""Mistral tool calls: [TOOL_CALLS][{"name": "NAME", "arguments": {...}}, ...], all calls in one list."""
from __future__ import annotations

from app.tools.base import WireFormat
from app.tools.format import ToolFormat


class MistralFormat(ToolFormat):
    name = "mistral"
    wire = WireFormat(trigger="[TOOL_CALLS]", section_begin="[TOOL_CALLS][", separator=", ", section_end="]",
                      markers=("[TOOL_CALLS]",), list_calls=True)

    def detect(self, chat_template: str) -> bool:
        return "[TOOL_CALLS]" in chat_template
