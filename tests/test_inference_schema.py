"""The inference API in ``/api/schema/``: ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` with every parameter the API acts on, its bounds the ones enforced, and its error
answers; and the request types agree with the API's own checks on bodies inside and outside them."""

from __future__ import annotations

import pytest
from django.conf import settings
from pydantic import ValidationError

from marketplace.api import inference_schema, request_body
from marketplace.jobs.errors import InvalidRequest
from marketplace.jobs.params import MAX_STOP, MAX_TOP_LOGPROBS, TEMPERATURE_RANGE, TOP_P_RANGE

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
