"""Tool calling for models whose chat template knows no tools (the embedded SmolLM2): the Hermes wire
format, with the tools described by a system prompt that this module writes."""
from __future__ import annotations

import json

from app.tools.base import tool_name, tool_parameters
from app.tools.format import ToolFormat
from app.tools.grammar import chosen_tools
from app.tools.hermes import HERMES_WIRE


class GenericFormat(ToolFormat):
    name = "generic"
    wire = HERMES_WIRE

    def detect(self, chat_template: str) -> bool:
        return True  # the fallback: any template

    def system_prompt(self, tools: list[dict], tool_choice: str | dict = "auto",
                      parallel_tool_calls: bool = True) -> str:
        """The tools (name, description, parameters schema), the exact call format and what
        tool_choice asks, as a system message text."""
        allowed, mode = chosen_tools(tools, tool_choice)
        lines = ["You can call the following tools.", ""]
        for tool in tools:
            description = tool["function"].get("description")
            lines.append(f"- {tool_name(tool)}" + (f": {description}" if description else ""))
            lines.append(f"  Parameters (JSON Schema): {json.dumps(tool_parameters(tool))}")
        lines += ["", "To call a tool, write exactly:", "<tool_call>",
                  '{"name": <tool name>, "arguments": <the arguments as a JSON object>}', "</tool_call>"]
        if mode == "forced":
            lines.append(f"You must call the tool {tool_name(allowed[0])} exactly once, and write nothing else.")
        elif mode == "required":
            lines.append("You must call at least one tool; write the call first, with no text before it.")
        else:
            lines.append("Call a tool only when you need it to answer; otherwise reply normally.")
        if parallel_tool_calls and mode != "forced":
            lines.append("To call several tools, write one <tool_call> block per call, one per line.")
        lines.append("After your tool calls, stop: the results will be sent to you.")
        return "\n".join(lines)
