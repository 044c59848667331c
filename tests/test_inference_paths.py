"""The inference API's paths as a client meets them on the real ASGI app (uvicorn): every answer
under /v1 is JSON in OpenAI's shape, an unknown path's and a server error's included, with the
security headers and request id of every answer; the dashboards keep their own middleware."""

from __future__ import annotations

import asyncio

import httpx2
import openai
import pytest
from django.contrib.auth import get_user_model

from marketplace.api import openai as inference
from marketplace.api import reply
from marketplace.jobs import services as jobs_services
from marketplace.monitoring import middleware as metrics_middleware
from tests.api_fixtures import MODEL, module_db
from tests.live import LiveServer

pytestmark = [pytest.mark.api]
db = module_db


@pytest.fixture(scope="module")
def server(db):
    live = LiveServer().start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def key(db) -> str:
    customer = get_user_model().objects.create_user("dana", "dana@example.test", None, is_customer=True)
    return jobs_services.create_api_key(customer, "dana's app")[1]


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize(
    "call",
    [
        lambda client: client.embeddings.create(model=MODEL, input="hello"),
        lambda client: client.responses.create(model=MODEL, input="hello"),
        lambda client: client.images.generate(prompt="a dragon"),
    ],
    ids=["embeddings", "responses", "images"],
)
def test_an_endpoint_of_openais_this_server_lacks_is_a_json_501_the_sdk_reads(server, key, call):
    with pytest.raises(openai.APIStatusError) as caught:
        call(sdk(server, key))

    assert caught.value.status_code == 501
    body = caught.value.response.json()
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "unsupported_endpoint"
    assert caught.value.message.startswith(f"Error code: 501 - {caught.value.response.request.method} ")
    assert caught.value.response.request.url.path in body["error"]["message"]
    assert "/v1/chat/completions" in body["error"]["message"]  # it says what this server answers


@pytest.mark.parametrize("path", ["/v1", "/v1/", "/v1/chat/completions/extra", "/v1/models/x/y", "/v1/nope"])
def test_any_unknown_path_under_v1_is_json(server, path):
    response = httpx2.get(f"{server.url}{path}", timeout=30)

    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "unknown_url"


def test_a_server_error_under_v1_is_json_in_openais_shape(server, key, monkeypatch):
    def broken() -> list[str]:
        raise RuntimeError("the catalog is unreadable")

    monkeypatch.setattr(inference, "served_models", broken)

    response = httpx2.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)

    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "unreadable" not in response.text  # nothing of the exception goes out
    assert response.headers["x-request-id"].startswith("req_")  # what the message asks the client to quote


def test_api_answers_carry_the_security_headers_and_request_id_and_set_no_cookie(server, key):
    response = httpx2.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)

    assert response.status_code == 200
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-request-id"].startswith("req_")
    assert "set-cookie" not in response.headers


def test_the_dashboards_keep_their_middleware(server):
    response = httpx2.get(f"{server.url}/login/", timeout=30)

    assert response.status_code == 200
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["x-content-type-options"] == "nosniff"
    assert "csrftoken" in response.headers.get("set-cookie", "")


def test_a_stream_stopped_early_is_closed_at_once_through_what_wraps_it():
    """Django closes only the outermost of its wrappers of an async stream; a response's stream
    (and the metrics' timer around it) must end when the response stops, not when the garbage
    collector finds it: its end stops the request's jobs and lets its Idempotency-Key go."""
    ended: list[str] = []

    async def source():
        try:
            for part in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"):
                yield part
        finally:
            ended.append("source")

    async def client_leaves_after_one_part(response) -> tuple[bytes, list[str]]:
        stream = aiter(response)
        got = await anext(stream)
        await stream.aclose()  # what Django's handler does when the client is gone
        return got, list(ended)  # before the loop's own shutdown closes whatever is left

    content = source()  # held here: only an explicit close can end it
    response = reply.EventStream(content)
    wrapped = metrics_middleware._timed(response.streaming_content, lambda: ended.append("timed"))
    response.streaming_content = wrapped  # as the metrics middleware wraps it

    assert asyncio.run(client_leaves_after_one_part(response)) == (b"data: 1\n\n", ["source", "timed"])
    assert response["content-type"] == "text/event-stream" and response["cache-control"] == "no-cache"
