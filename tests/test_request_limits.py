"""Requests that used to answer 500 (or to cost seconds of tokenizing) are refused up front with a
4xx and a clear message: a prompt over SWARM_MAX_PROMPT_BYTES (before the tokenizer sees it), a
body over SWARM_MAX_REQUEST_BYTES, JSON nested past MAX_JSON_DEPTH, a role that is not a string,
a seed outside int64 (before any job exists), an out-of-range ``limit`` or ``offset``. The
inference API is driven with the official ``openai`` client against the live ASGI app."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest
from openai import OpenAI
from rest_framework.test import APIClient

from marketplace.api.parsers import MAX_JSON_DEPTH
from marketplace.flows import admission
from marketplace.jobs import services as jobs_services
from marketplace.jobs.models import ApiKey, Job
from marketplace.jobs.services import create_api_key
from tests.live import LiveServer

pytestmark = [pytest.mark.api, pytest.mark.django_db(transaction=True)]

MODEL = "smollm2-135m"


@pytest.fixture
def api(settings, django_user_model):
    """The live app with no agents (a valid request would answer 503), and a customer's key."""
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_COORDINATOR_LAUNCH = "inprocess"
    settings.SWARM_EMBEDDED_SCHEDULER = False
    customer = django_user_model.objects.create_user(username="c", email="c@e.com", password="x", is_customer=True)
    api_key, key = create_api_key(customer, "limits")
    ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=10_000, tokens_per_minute=10_000_000)
    server = LiveServer().start()
    try:
        yield server, key
    finally:
        server.stop()


@pytest.fixture
def calls(monkeypatch):
    """Records each call that reaches the tokenizer or admission (which creates the job)."""
    seen = []
    encode, admit = jobs_services.encode_prompt, admission.admit_job

    def recording_encode(*args, **kwargs):
        seen.append("tokenize")
        return encode(*args, **kwargs)

    def recording_admit(*args, **kwargs):
        seen.append("admit")
        return admit(*args, **kwargs)

    monkeypatch.setattr(jobs_services, "encode_prompt", recording_encode)
    monkeypatch.setattr(admission, "admit_job", recording_admit)
    return seen


def client_of(api) -> OpenAI:
    server, key = api
    return OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def error_of(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_a_prompt_over_the_byte_limit_is_refused_before_tokenizing(api, calls):
    prompt = "word " * 480_000  # 2.4 MB

    with pytest.raises(openai.BadRequestError) as refused:
        client_of(api).completions.create(model=MODEL, prompt=prompt, max_tokens=4)

    assert error_of(refused.value) == {
        "message": "The prompt is 2400000 bytes of text; this server accepts at most 262144. Shorten the prompt.",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }
    assert calls == []
    assert Job.objects.count() == 0


def test_chat_messages_count_together_against_the_byte_limit(api, calls, settings):
    settings.SWARM_MAX_PROMPT_BYTES = 1000
    messages = [{"role": "user", "content": "é" * 300}, {"role": "user", "content": "x" * 401}]  # 600 + 401 bytes

    with pytest.raises(openai.BadRequestError) as refused:
        client_of(api).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)

    assert (error_of(refused.value)["code"], error_of(refused.value)["param"]) == (
        "context_length_exceeded",
        "messages",
    )
    assert error_of(refused.value)["message"] == (
        "The prompt is 1001 bytes of text; this server accepts at most 1000. Shorten the messages."
    )
    assert calls == []


def test_a_prompt_at_the_byte_limit_is_tokenized(api, calls, settings):
    settings.SWARM_MAX_PROMPT_BYTES = 1000

    with pytest.raises(openai.APIStatusError) as no_capacity:
        client_of(api).completions.create(model=MODEL, prompt="x" * 1000, max_tokens=4)

    assert no_capacity.value.status_code == 503
    assert calls == ["tokenize", "admit"]


def test_a_body_over_the_request_limit_answers_413(api, settings):
    settings.SWARM_MAX_REQUEST_BYTES = settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000

    with pytest.raises(openai.APIStatusError) as refused:
        client_of(api).completions.create(model=MODEL, prompt="x" * 20_000, max_tokens=4)

    assert refused.value.status_code == 413
    assert error_of(refused.value) == {
        "message": "The request body is larger than 10000 bytes.",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 100_000])
def test_deeply_nested_json_is_a_bad_request(api, levels, calls):
    server, key = api
    body = f'{{"model": "{MODEL}", "messages": {nested(levels - 1)}}}'

    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=60,
    )

    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert calls == []


def test_nesting_up_to_the_bound_is_read(api, calls):
    server, key = api
    body = f'{{"model": "{MODEL}", "messages": {nested(MAX_JSON_DEPTH - 1)}}}'

    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=60,
    )

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.0.role"  # parsed, then refused for its content


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 100_000])
def test_deeply_nested_json_to_agent_registration_is_a_bad_request(levels):
    body = f'{{"token": {nested(levels - 1)}}}'

    response = APIClient().post("/api/v1/agents/register", body, content_type="application/json")

    assert response.status_code == 400
    assert response.json() == {
        "detail": f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels."
    }


@pytest.mark.parametrize("role", [["user"], {"r": "user"}, 7])
def test_a_role_that_is_not_a_string_is_a_bad_request(api, role, calls):
    with pytest.raises(openai.BadRequestError) as refused:
        client_of(api).chat.completions.create(model=MODEL, messages=[{"role": role, "content": "hi"}], max_tokens=4)

    assert error_of(refused.value) == {
        "message": "messages[0] needs a role of ['assistant', 'developer', 'system', 'tool', 'user'].",
        "type": "invalid_request_error",
        "param": "messages.0.role",
        "code": None,
    }
    assert calls == []


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_a_seed_outside_int64_is_refused_before_any_job_exists(api, seed, calls):
    with pytest.raises(openai.BadRequestError) as refused:
        client_of(api).completions.create(model=MODEL, prompt="Hello", max_tokens=4, seed=seed)

    assert error_of(refused.value) == {
        "message": "'seed' must be an integer in [-9223372036854775808, 9223372036854775807].",
        "type": "invalid_request_error",
        "param": "seed",
        "code": None,
    }
    assert calls == []
    assert Job.objects.count() == 0


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_a_seed_at_the_ends_of_int64_is_accepted(api, seed, calls):
    with pytest.raises(openai.APIStatusError) as no_capacity:
        client_of(api).completions.create(model=MODEL, prompt="Hello", max_tokens=4, seed=seed)

    assert no_capacity.value.status_code == 503
    assert calls == ["tokenize", "admit"]


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("limit=" + "9" * 30, {"limit": ["'limit' must be between 1 and 1000, got " + "9" * 30 + "."]}),
        ("limit=0", {"limit": ["'limit' must be between 1 and 1000, got 0."]}),
        ("limit=ten", {"limit": ["'limit' must be a whole number."]}),
        ("offset=" + "9" * 30, {"offset": ["'offset' must be between 0 and 1000000000, got " + "9" * 30 + "."]}),
    ],
    ids=["huge-limit", "zero-limit", "not-a-number", "huge-offset"],
)
@pytest.mark.parametrize("endpoint", ["/api/v1/nodes/", "/api/v1/keys/"])
def test_an_out_of_range_page_is_a_bad_request(django_user_model, endpoint, query, message):
    user = django_user_model.objects.create_user(
        username="pc", email="pc@e.com", password="x", is_provider=True, is_customer=True
    )
    client = APIClient()
    client.force_login(user)

    response = client.get(f"{endpoint}?{query}")

    assert response.status_code == 400
    assert response.json() == message


def test_the_largest_page_is_served(django_user_model):
    user = django_user_model.objects.create_user(username="p", email="p@e.com", password="x", is_provider=True)
    client = APIClient()
    client.force_login(user)

    response = client.get("/api/v1/nodes/?limit=1000")

    assert response.status_code == 200
    assert response.json() == {"count": 0, "next": None, "previous": None, "results": []}


@pytest.mark.parametrize("key", ["frobnicate", "temprature", "max_new_tokens"])
def test_an_unknown_argument_is_refused_by_name_before_tokenizing(api, calls, key):
    with pytest.raises(openai.BadRequestError) as refused:
        client_of(api).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body={key: 1}
        )

    assert error_of(refused.value) == {
        "message": f"Unrecognized request argument supplied: {key}",
        "type": "invalid_request_error",
        "param": key,
        "code": "unknown_parameter",
    }
    assert calls == []
    assert Job.objects.count() == 0


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    ("kind", "arguments", "param"),
    [
        ("chat", {"functions": [TOOL["function"]]}, "functions"),
        ("chat", {"function_call": "auto"}, "function_call"),
        ("completion", {"tools": [TOOL]}, "tools"),
        ("completion", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"store": True}, "store"),
        ("completion", {"echo": True}, "echo"),
        ("completion", {"best_of": 3}, "best_of"),
        ("completion", {"suffix": "!"}, "suffix"),
    ],
)
def test_an_argument_this_api_does_not_implement_is_refused_by_name(api, calls, kind, arguments, param):
    """Nothing is silently ignored: an OpenAI argument that would change the answer, and that this
    API does not implement, is refused naming it (never a 200 that did not do what was asked)."""
    client = client_of(api)
    with pytest.raises(openai.BadRequestError) as refused:
        if kind == "chat":
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=arguments
            )
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=arguments)

    assert error_of(refused.value) == {
        "message": f"Unsupported parameter: '{param}' is not supported by this API yet.",
        "type": "invalid_request_error",
        "param": param,
        "code": "unsupported_parameter",
    }
    assert calls == []


def test_a_history_with_tool_calls_and_results_is_accepted(api, calls):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]

    with pytest.raises(openai.APIStatusError) as no_capacity:
        client_of(api).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)

    assert no_capacity.value.status_code == 503  # validated and tokenized; no agents here
    assert calls == ["tokenize", "admit"]


def test_a_message_field_this_api_does_not_implement_is_refused_naming_it(api, calls):
    messages = [{"role": "user", "content": "hi", "name": "carol"}]

    with pytest.raises(openai.BadRequestError) as refused:
        client_of(api).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)

    assert error_of(refused.value)["param"] == "messages.0.name"
    assert error_of(refused.value)["code"] == "unsupported_parameter"
    assert calls == []


def test_arguments_that_ask_for_nothing_are_accepted(api, calls):
    """The values that change nothing (as LangChain and LiteLLM send them) pass validation: the
    request is tokenized and reaches admission, which answers 503 here (no agents)."""
    with pytest.raises(openai.APIStatusError) as no_capacity:
        client_of(api).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            n=1,
            presence_penalty=0,
            frequency_penalty=0.0,
            logprobs=False,
            response_format={"type": "text"},
            parallel_tool_calls=True,
            extra_body={"logit_bias": {}, "tools": [], "service_tier": "auto", "top_logprobs": None},
        )

    assert no_capacity.value.status_code == 503
    assert calls == ["tokenize", "admit"]
