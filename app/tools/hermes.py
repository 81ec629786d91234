"""Hermes / Qwen2.5 tool calls: <tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>, one block
per call, blocks separated by a newline."""
from __future__ import annotations

from app.tools.base import WireFormat
from app.tools.format import ToolFormat

HERMES_WIRE = WireFormat(trigger="<tool_call>", call_begin="<tool_call>\n", call_end="\n</tool_call>",
                         separator="\n", markers=("<tool_call>",), call_close="</tool_call>")


class HermesFormat(ToolFormat):
    name = "hermes"
    wire = HERMES_WIRE

    def detect(self, chat_template: str) -> bool:
        return "<tool_call>" in chat_template
