"""Tool calling through the OpenAI-compatible API with the official ``openai`` client: a loop of
call -> tool result -> final answer with ``tool_choice`` "auto" (the default: the model chooses
between a call and words), "required" and a named function, streamed calls, one call only when
``parallel_tool_calls`` is false, the history a client sends back, and the refusals (bad tools).
A live control plane serves smollm2-135m over three joined agents; smollm2's chat template renders
no tools, so the functions reach it in a system message and its calls are constrained to their
schemas."""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI

from marketplace.jobs import tools
from marketplace.jobs.models import Job
from tests.api_fixtures import MODEL, module_db

pytestmark = [pytest.mark.api]
pytest_plugins = ["tests.api_fixtures"]
db = module_db

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city now.", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city.",
            "parameters": CITY | {"additionalProperties": False},
        },
    },
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture
def client(live_swarm) -> OpenAI:
    return OpenAI(base_url=f"{live_swarm.url}/v1", api_key=live_swarm.key, max_retries=0, timeout=180)


def call_loop(client: OpenAI, tool_choice, **options) -> tuple:
    """Ask, get a call, answer it with a tool result, get the final text."""
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=64, temperature=0, **options,
        **({} if tool_choice is None else {"tool_choice": tool_choice}),
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    history = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees Celsius."},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0
    )
    return first, call, final


def test_a_required_call_then_its_result_then_the_final_answer(client):
    first, call, final = call_loop(client, "required")

    assert call.function.name in {"get_weather", "get_time"}
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    answer = final.choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content
    assert answer.finish_reason in ("stop", "length")
    job = Job.objects.get(public_id=first.id)
    assert job.params["tool_choice"] == "required"
    assert [tool["name"] for tool in job.params["tools"]] == ["get_weather", "get_time"]


def test_by_default_the_model_chooses_a_call_then_answers_its_result_in_words(client):
    # smollm2-135m's template renders no tools: it is asked to decide first, and says "Yes".
    first, call, _ = call_loop(client, None)

    assert call.function.name in {"get_weather", "get_time"}
    assert set(json.loads(call.function.arguments)) == {"city"}
    job = Job.objects.get(public_id=first.id)
    assert (job.params["tool_choice"], job.params["tool_decides"]) == ("auto", True)
    # With the tools still offered after the result, it chooses words.
    history = [
        *QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees Celsius."},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=32, temperature=0)
    assert answer.choices[0].message.tool_calls is None
    content = answer.choices[0].message.content
    assert content and not content.startswith("{") and not content.startswith(("Yes", "No\n"))  # the decision left out
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_auto_answers_in_words_when_no_function_fits(client):
    question = [{"role": "user", "content": "Write one short sentence about the sea."}]
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL, messages=question, tools=TOOLS, tool_choice="auto", max_tokens=24, temperature=0, stream=stream
        )
        if stream:
            deltas = [c.choices[0].delta for c in response if c.choices]
            assert not any(delta.tool_calls for delta in deltas)
            streamed = "".join(delta.content or "" for delta in deltas)
            assert streamed and not streamed.startswith(("No", "Yes")), streamed
        else:
            assert response.choices[0].message.tool_calls is None
            content = response.choices[0].message.content
            assert content and not content.startswith(("No", "Yes")), content  # words, not the decision


def test_without_parallel_calls_a_response_holds_one_call(client):
    first, _, _ = call_loop(client, "required", parallel_tool_calls=False)

    assert len(first.choices[0].message.tool_calls) == 1
    assert Job.objects.get(public_id=first.id).params["parallel_tool_calls"] is False


def test_a_named_function_is_the_one_called(client):
    _, call, final = call_loop(client, {"type": "function", "function": {"name": "get_time"}})

    assert call.function.name == "get_time"
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert final.choices[0].message.content


def test_a_streamed_call_arrives_as_a_tool_calls_delta(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=64,
            temperature=0,
            stream=True,
        )
    )

    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for delta in deltas if delta.tool_calls for call in delta.tool_calls]
    assert [call.function.name for call in calls] == ["get_weather"]
    assert set(json.loads(calls[0].function.arguments)) == {"city"}
    assert not any(delta.content for delta in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_answers_in_text(client):
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )

    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content


@pytest.mark.parametrize(
    ("arguments", "param", "code"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", None),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
            "tools.0.function.name",
            None,
        ),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", None),
        ({"tool_choice": "required"}, "tool_choice", None),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            None,
        ),
    ],
    ids=["unknown-name", "bad-name", "twice", "no-tools", "with-response-format"],
)
def test_tool_requests_this_api_cannot_honour_are_refused_400(client, arguments, param, code):
    jobs = Job.objects.count()

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, extra_body=arguments)

    error = refused.value.response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert Job.objects.count() == jobs


def test_a_tool_message_needs_its_call_id(client):
    history = [*QUESTION, {"role": "tool", "content": "Sunny."}]

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=history, max_tokens=8)

    assert refused.value.response.json()["error"]["param"] == "messages.1.tool_call_id"


def test_a_call_names_only_the_arguments_its_function_declares():
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "open": {"type": "object", "additionalProperties": True, "properties": {}},
        },
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }

    narrowed = tools.declared_only(schema)

    assert narrowed["additionalProperties"] is False
    assert narrowed["properties"]["properties"]["additionalProperties"] is False  # a property named "properties"
    assert set(narrowed["properties"]) == {"properties", "open"}
    assert narrowed["properties"]["open"]["additionalProperties"] is True  # what the schema says stays
    assert narrowed["$defs"]["Point"]["additionalProperties"] is False
