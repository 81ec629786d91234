"""Llama 3.1+ JSON tool calls: {"name": "NAME", "parameters": {...}}, optionally after <|python_tag|>.

Parallel calls are joined by "; " (what vLLM's llama3_json parser splits on); the parser also takes
newlines or a <|python_tag|> before each call.
"""
from __future__ import annotations

from app.tools.base import WireFormat
from app.tools.format import ToolFormat

# Text only Llama 3.1+ templates hold: the built-in tool marker and the custom-tool JSON instruction.
LLAMA3_TEMPLATE_SIGNS = ("<|python_tag|>", "<|eom_id|>", "Environment: ipython", '"parameters": dictionary')


class Llama3Format(ToolFormat):
    name = "llama3"
    # The trigger is the parser's JSON start, so free text can hold nothing the parser would take for a call.
    wire = WireFormat(trigger='{"name"', args_key="parameters", separator="; ", markers=("<|python_tag|>",),
                      json_starts=('{"name"',), separators=";")

    def detect(self, chat_template: str) -> bool:
        return any(sign in chat_template for sign in LLAMA3_TEMPLATE_SIGNS)
