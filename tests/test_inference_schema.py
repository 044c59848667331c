"""The inference API's request types (``marketplace/api/inference_schema.py``): they validate every
request (``request_body.parse``) and document it in ``/api/schema/``: ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models`` with every parameter the API acts on, its bounds the ones
enforced (the settings' among them), and its error answers. A value they refuse is answered in the
API's words: a message naming the value, its ``param`` path and code, nested values included. The
tools, which ``jobs.tools`` checks, are described by the types as that check accepts them."""

from __future__ import annotations

import pytest
from django.conf import settings
from pydantic import ValidationError

from marketplace.api import inference_schema, request_body
from marketplace.jobs.errors import InvalidRequest
from marketplace.jobs.params import (
    MAX_COMPLETION_LOGPROBS,
    MAX_STOP,
    MAX_TOP_LOGPROBS,
    TEMPERATURE_RANGE,
    TOP_P_RANGE,
)

pytestmark = [pytest.mark.api, pytest.mark.django_db]

MODEL = "smollm2-135m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time"}


@pytest.fixture
def schema(client) -> dict:
    answer = client.get("/api/schema/", {"format": "json"})
    assert answer.status_code == 200
    return answer.json()


def request_schema(schema: dict, path: str) -> dict:
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_the_schema_lists_the_inference_api_with_every_parameter_it_acts_on(schema):
    assert {"/v1/models", "/v1/chat/completions", "/v1/completions"} <= set(schema["paths"])
    assert "get" in schema["paths"]["/v1/models"]
    for path, kind in (("/v1/chat/completions", "chat"), ("/v1/completions", "completion")):
        body = request_schema(schema, path)
        assert set(body["properties"]) == set(request_body.REQUEST_KEYS[kind]), path
        assert body["required"] == ["model", "messages"] if kind == "chat" else ["model", "prompt"]
        operation = schema["paths"][path]["post"]
        assert {"200", "400", "401", "402", "404", "429", "503"} <= set(operation["responses"])
        assert "Retry-After" in operation["responses"]["503"]["headers"]
        assert operation["security"] == [{"ApiKeyBearer": []}]
    assert schema["components"]["securitySchemes"]["ApiKeyBearer"]["scheme"] == "bearer"


def test_the_documented_bounds_are_the_enforced_ones(schema):
    chat = request_schema(schema, "/v1/chat/completions")["properties"]

    assert (chat["temperature"]["minimum"], chat["temperature"]["maximum"]) == TEMPERATURE_RANGE
    assert (chat["top_p"]["exclusiveMinimum"], chat["top_p"]["maximum"]) == TOP_P_RANGE
    assert chat["n"]["maximum"] == settings.SWARM_MAX_CHOICES
    top = next(option for option in chat["top_logprobs"]["anyOf"] if option.get("type") == "integer")
    assert top["maximum"] == MAX_TOP_LOGPROBS
    assert set(chat["tool_choice"]["anyOf"][0]["enum"]) == {"none", "auto", "required"}


VALID = 3  # the first bodies are valid, the rest each break one rule
BODIES = [
    ("chat", CHAT | {"temperature": 0, "max_tokens": 8, "stop": ["\n"], "tools": [], "logprobs": True}),
    ("chat", CHAT | {"tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("completion", COMPLETION | {"logprobs": 2, "seed": 7, "provider": {"trusted_only": True}}),
    ("chat", CHAT | {"temperature": 2.5}),
    ("chat", CHAT | {"top_p": 0}),
    ("chat", CHAT | {"stop": ["a"] * (MAX_STOP + 1)}),
    ("chat", CHAT | {"top_logprobs": MAX_TOP_LOGPROBS + 1, "logprobs": True}),
    ("chat", CHAT | {"tool_choice": "sometimes"}),
    ("chat", CHAT | {"frobnicate": 1}),
    ("chat", {"model": MODEL, "messages": []}),
    ("completion", COMPLETION | {"logprobs": 6}),
    ("completion", COMPLETION | {"provider": {"fastest": True}}),
]


@pytest.mark.parametrize(("kind", "body"), BODIES)
def test_the_request_types_accept_what_the_api_accepts(kind, body):
    valid = BODIES.index((kind, body)) < VALID
    try:
        request_body.parse(body, kind)
        accepted = True
    except InvalidRequest:
        accepted = False
    try:
        inference_schema.REQUEST_TYPES[kind].model_validate(body)
        described = True
    except ValidationError:
        described = False

    assert (accepted, described) == (valid, valid), body


REFUSALS = [  # (kind, body, message, param, code)
    ("chat", {"messages": CHAT["messages"]}, "'model' is required.", "model", "invalid_request"),
    ("chat", CHAT | {"n": 99}, f"'n' must be an integer in [1, {settings.SWARM_MAX_CHOICES}].", "n", "invalid_request"),
    (
        "chat",
        CHAT | {"max_completion_tokens": 0},
        f"'max_completion_tokens' must be an integer in [1, {settings.SWARM_MAX_TOKENS_LIMIT}].",
        "max_completion_tokens",
        "invalid_request",
    ),
    ("chat", CHAT | {"temperature": True}, "'temperature' must be a number.", "temperature", "invalid_request"),
    ("chat", CHAT | {"top_p": 0}, "'top_p' must be in (0, 1], got 0.", "top_p", "invalid_request"),
    (
        "chat",
        CHAT | {"stop": ""},
        f"'stop' must be a string or up to {MAX_STOP} non-empty strings.",
        "stop",
        "invalid_request",
    ),
    (
        "chat",
        CHAT | {"logit_bias": {"5": 200}},
        "'logit_bias.5' must be in [-100, 100], got 200.",
        "logit_bias.5",
        "invalid_request",
    ),
    (
        "chat",
        CHAT | {"logit_bias": {"a": 1}},
        "'logit_bias' keys must be token ids, got 'a'.",
        "logit_bias",
        "invalid_request",
    ),
    (
        "chat",
        CHAT | {"stream_options": {"include_usage": 1}},
        "'stream_options.include_usage' must be a boolean.",
        "stream_options.include_usage",
        "invalid_request",
    ),
    (
        "chat",
        CHAT | {"provider": {"trusted_only": "yes"}},
        "'provider.trusted_only' must be a boolean.",
        "provider.trusted_only",
        "invalid_request",
    ),
    (
        "completion",
        COMPLETION | {"provider": {"fastest": True}},
        "Unsupported parameter: provider.fastest is not supported; provider routing here takes trusted_only and "
        "trusted_ends.",
        "provider.fastest",
        "unsupported_parameter",
    ),
    (
        "chat",
        CHAT | {"top_logprobs": 2},
        "'top_logprobs' needs 'logprobs' set to true.",
        "top_logprobs",
        "invalid_request",
    ),
    (
        "chat",
        CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
        "'response_format.json_schema' needs a 'name' of 1-64 letters, digits, '_' or '-'.",
        "response_format.json_schema.name",
        "invalid_request",
    ),
    (
        "chat",
        {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]},
        "messages[0] needs a role of ['assistant', 'developer', 'system', 'tool', 'user'].",
        "messages.0.role",
        "invalid_request",
    ),
    (
        "chat",
        {"model": MODEL, "messages": [{"role": "user", "content": "x", "name": "bob"}]},
        "Unsupported parameter: messages[0].name is not supported by this API yet.",
        "messages.0.name",
        "unsupported_parameter",
    ),
    (
        "chat",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content supports text parts only.",
        "messages.0.content",
        "invalid_request",
    ),
    (
        "chat",
        {"model": MODEL, "messages": [{"role": "assistant"}]},
        "messages[0].content must be a string.",
        "messages.0.content",
        "invalid_request",
    ),
    (
        "chat",
        {"model": MODEL, "messages": [{"role": "tool", "content": "sunny"}]},
        "messages[0] needs a 'tool_call_id'.",
        "messages.0.tool_call_id",
        "invalid_request",
    ),
    (
        "completion",
        COMPLETION | {"prompt": ["a", "b"]},
        "'prompt' must be a non-empty string.",
        "prompt",
        "invalid_request",
    ),
    (
        "completion",
        COMPLETION | {"logprobs": True},
        f"'logprobs' must be an integer in [0, {MAX_COMPLETION_LOGPROBS}].",
        "logprobs",
        "invalid_request",
    ),
]


@pytest.mark.parametrize(("kind", "body", "message", "param", "code"), REFUSALS)
def test_a_value_the_types_refuse_is_answered_in_the_api_s_words(kind, body, message, param, code):
    with pytest.raises(InvalidRequest) as refused:
        request_body.parse(body, kind)

    assert (str(refused.value), refused.value.param, refused.value.code) == (message, param, code)


def test_the_bounds_that_are_settings_are_read_at_each_request(settings):
    settings.SWARM_MAX_CHOICES = 3
    assert request_body.parse(CHAT | {"n": 3}, "chat")[1].n == 3
    with pytest.raises(InvalidRequest, match=r"'n' must be an integer in \[1, 3\]\."):
        request_body.parse(CHAT | {"n": 4}, "chat")
