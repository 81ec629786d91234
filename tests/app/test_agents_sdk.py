"""The openai-agents SDK against the shared server (the embedded SmolLM2): an Agent with one
function tool, through the Responses API (OpenAIResponsesModel, run and streamed) and through chat
completions (OpenAIChatCompletionsModel), calls the tool and finishes.

tool_choice "required" makes the first turn a call under the grammar; the agent stops at the tool's
result (stop_on_first_tool), because this small model, left to choose, calls the tool again.
"""
from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI

from tests.app.conftest import MODEL_NAME, Server


def run_agent(server: Server, api: str, streamed: bool) -> tuple[str, list[str]]:
    """(the agent's final output, the cities the tool was called with); api is "responses" or "chat"."""
    # Imported here: the SDK takes seconds to import, which collecting the suite need not pay.
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)  # the SDK would export traces to OpenAI
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"Sunny and 21 C in {city}."

    async def go() -> str:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
                      tool_use_behavior="stop_on_first_tool",
                      model=model_class(model=MODEL_NAME, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                   max_tokens=60))
        if not streamed:
            return (await Runner.run(agent, "What is the weather in Paris?", max_turns=2)).final_output
        result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=2)
        async for _ in result.stream_events():
            pass
        return result.final_output

    return asyncio.run(go()), cities


@pytest.mark.parametrize("api, streamed", [("responses", False), ("responses", True), ("chat", False)],
                         ids=["responses", "responses-streamed", "chat-completions"])
def test_agent_calls_its_tool_and_finishes(server: Server, api: str, streamed: bool) -> None:
    output, cities = run_agent(server, api, streamed)
    assert len(cities) == 1 and cities[0]
    assert output == f"Sunny and 21 C in {cities[0]}."
