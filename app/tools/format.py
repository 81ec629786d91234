"""ToolFormat: one model family's tool calling (detection, grammar, prompt, parser) built on its WireFormat."""
from __future__ import annotations

import json

from app.tools.base import WireFormat
from app.tools.grammar import structural_tag
from app.tools.parser import ToolCallParser


class ToolFormat:
    """A model family's tool-call format; subclasses set `name` and `wire` and say how to detect it."""

    name: str
    wire: WireFormat

    def detect(self, chat_template: str) -> bool:
        """Whether a chat template writes tool calls in this format."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], tool_choice: str | dict = "auto", parallel_tool_calls: bool = True) -> str:
        """The xgrammar structural tag JSON that constrains a reply (see app/tools/grammar.py for
        its shapes). tool_choice is "auto", "required", a function name or OpenAI's
        {"type": "function", "function": {"name": ...}}; a name not in tools raises InvalidRequestError."""
        return structural_tag(self.wire, tools, tool_choice, parallel_tool_calls)

    def system_prompt(self, tools: list[dict], tool_choice: str | dict = "auto",
                      parallel_tool_calls: bool = True) -> str | None:
        """Text describing the tools for templates that cannot; None where the template does it."""
        return None

    def parser(self) -> ToolCallParser:
        """A fresh streaming parser for one choice's output."""
        return ToolCallParser(self.wire)

    def render_calls(self, tool_calls: list[dict]) -> str:
        """Earlier calls ({"function": {"name", "arguments"}} as in an assistant message) written as
        the model writes them, e.g. for templates that cannot render tool_calls themselves."""
        w = self.wire
        calls = [f'{w.call_begin}{{"name": {json.dumps(c["function"]["name"])}, {json.dumps(w.args_key)}: '
                 f'{c["function"].get("arguments") or "{}"}}}{w.call_end}' for c in tool_calls]
        return w.section_begin + w.separator.join(calls) + w.section_end

    def __repr__(self) -> str:
        return f"<ToolFormat {self.name}>"
