"""The API as LangChain (``langchain-openai``) and LiteLLM use it: structured output and tool
binding, each library pointed at a live control plane serving smollm2-135m over three joined
agents, with nothing but its base URL and key changed. Nothing here reaches the network: both
libraries take their tokenizer data from their own wheels."""

from __future__ import annotations

import json
import os

# LiteLLM would fetch its model price list from GitHub at import; its own copy serves here.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.api_fixtures import MODEL, module_db

pytestmark = [pytest.mark.api]
pytest_plugins = ["tests.api_fixtures"]
db = module_db


class City(BaseModel):
    """A city and its country."""

    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


@tool
def get_weather(city: str) -> str:
    """The weather in a city now."""
    return "Sunny."


@pytest.fixture
def chat(live_swarm) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL,
        base_url=f"{live_swarm.url}/v1",
        api_key=live_swarm.key,
        temperature=0,
        max_tokens=64,
        max_retries=0,
    )


def test_langchain_with_structured_output_returns_the_object(chat):
    structured = chat.with_structured_output(City, method="json_schema")

    city = structured.invoke("Describe Paris as JSON.")

    assert isinstance(city, City)
    assert city.name


def test_langchain_bind_tools_yields_a_tool_call(chat):
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")

    message = bound.invoke("What is the weather in Rome?")

    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    assert set(call["args"]) == {"city"}


def test_a_langchain_agent_loop_with_one_tool_and_no_tool_choice(chat):
    """bind_tools as agent frameworks call it (no tool_choice: OpenAI's "auto"): the model
    chooses a call, gets the tool's result, then chooses a final answer in words."""
    bound = chat.bind_tools([get_weather])
    question = HumanMessage("What is the weather in Rome?")

    first = bound.invoke([question])

    assert first.tool_calls and {call["name"] for call in first.tool_calls} == {"get_weather"}
    results = [get_weather.invoke(call) for call in first.tool_calls]
    assert all(isinstance(result, ToolMessage) and result.content == "Sunny." for result in results)
    final = bound.invoke([question, first, *results])
    assert not final.tool_calls
    assert isinstance(final.content, str) and final.content.strip()


def test_litellm_structured_output_and_tools(live_swarm):
    common = {
        "model": f"openai/{MODEL}",
        "api_base": f"{live_swarm.url}/v1",
        "api_key": live_swarm.key,
        "temperature": 0,
        "max_tokens": 64,
    }

    structured = litellm.completion(
        messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City, **common
    )
    called = litellm.completion(
        messages=[{"role": "user", "content": "What is the weather in Rome?"}],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}},
                },
            }
        ],
        tool_choice="required",
        **common,
    )

    assert City.model_validate_json(structured.choices[0].message.content)
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert called.choices[0].finish_reason == "tool_calls"
