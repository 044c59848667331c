"""The API's OpenAPI document (/api/schema/) and its offline Swagger UI (/api/docs/)."""

from __future__ import annotations

import re

import pytest
from django.contrib.staticfiles import finders
from django.test import Client

pytestmark = [pytest.mark.control, pytest.mark.django_db]

OPENAPI_JSON = "application/vnd.oai.openapi+json"


@pytest.fixture
def schema() -> dict:
    response = Client().get("/api/schema/", HTTP_ACCEPT=OPENAPI_JSON)
    assert response.status_code == 200
    assert response["Content-Type"] == OPENAPI_JSON
    return response.json()


def test_schema_is_an_openapi_3_document_about_the_marketplace(schema):
    assert schema["openapi"].startswith("3.")
    assert schema["info"] == {
        "title": "Swarm marketplace API",
        "version": "0.1.0",
        "description": "The swarm marketplace: inference through its OpenAI-compatible API (`/v1`, with an API "
        "key as the bearer token), and nodes, keys, credits and billing through its REST API.",
    }


def test_schema_lists_every_endpoint(schema):
    assert {path: sorted(operations) for path, operations in schema["paths"].items()} == {
        "/api/v1/billing/balance": ["get"],
        "/api/v1/billing/top-ups": ["post"],
        "/api/v1/billing/transactions": ["get"],
        "/api/v1/billing/usage": ["get"],
        "/api/v1/billing/usage.csv": ["get"],
        "/api/v1/catalog/": ["get", "post"],
        "/api/v1/catalog/{name}/": ["get", "patch"],
        "/api/v1/keys/": ["get", "post"],
        "/api/v1/keys/{id}/": ["delete", "get", "patch"],
        "/api/v1/nodes/": ["get", "post"],
        "/api/v1/nodes/{id}/": ["delete", "get"],
        "/api/v1/nodes/{id}/drain/": ["post"],
        "/api/v1/nodes/{id}/rotate-token/": ["post"],
        "/api/v1/agents/register": ["post"],
        "/api/v1/agents/check-token": ["post"],
        "/v1/models": ["get"],
        "/v1/chat/completions": ["post"],
        "/v1/completions": ["post"],
    }


def test_schema_documents_the_join_request_and_its_answer(schema):
    register = schema["paths"]["/api/v1/agents/register"]["post"]
    assert register["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AgentRegister"
    }
    assert register["responses"]["201"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AgentRegistered"
    }
    assert register["security"] == [{}]  # an agent joins with its token, not a user's credentials
    components = schema["components"]["schemas"]
    assert sorted(components["AgentRegister"]["required"]) == [
        "benchmark",
        "data_url",
        "hardware",
        "public_key",
        "signature",
        "token",
    ]
    assert "csr" in components["AgentRegister"]["properties"]  # optional: an agent serving TLS sends one
    assert sorted(components["AgentRegistered"]["properties"]) == [
        "ca_certificate",  # both only when a CSR was sent
        "control_url",
        "heartbeat_interval_s",
        "node",
        "node_certificate",
        "ticket_key",
    ]
    assert sorted(components["AgentRegistered"]["required"]) == [
        "control_url",
        "heartbeat_interval_s",
        "node",
        "ticket_key",
    ]


def test_schema_shows_the_join_token_only_in_the_create_answer(schema):
    components = schema["components"]["schemas"]
    create = schema["paths"]["/api/v1/nodes/"]["post"]
    assert create["responses"]["201"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/NodeCreated"
    }
    assert {"join_token", "join_command"} <= set(components["NodeCreated"]["properties"])
    assert not {"join_token", "join_command"} & set(components["Node"]["properties"])


def test_schema_says_the_join_command_installs_the_agent(schema):
    components = schema["components"]["schemas"]
    rotate = schema["paths"]["/api/v1/nodes/{id}/rotate-token/"]["post"]
    assert rotate["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JoinToken"
    }
    described = {
        "type": "string",
        "readOnly": True,
        "description": "the one line to run on the machine, as the dashboard shows it: fetches the control "
        "plane's install script, which installs the agent and joins with the token (given in its environment, "
        "never as an argument)",
    }
    assert components["NodeCreated"]["properties"]["join_command"] == described
    assert components["JoinToken"]["properties"]["join_command"] == described


def test_schema_declares_session_and_basic_authentication_for_the_node_api(schema):
    assert schema["components"]["securitySchemes"] == {
        "basicAuth": {"type": "http", "scheme": "basic"},
        "cookieAuth": {"type": "apiKey", "in": "cookie", "name": "sessionid"},
        "ApiKeyBearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key from the dashboard (`sk-...`), as OpenAI's clients send it.",
        },
    }
    assert schema["paths"]["/api/v1/nodes/"]["get"]["security"] == [{"cookieAuth": []}, {"basicAuth": []}]


def test_schema_types_the_node_id_in_paths_as_an_integer(schema):
    parameters = schema["paths"]["/api/v1/nodes/{id}/"]["get"]["parameters"]

    assert [(p["in"], p["name"], p["schema"], p["required"]) for p in parameters] == [
        ("path", "id", {"type": "integer"}, True)
    ]


def test_schema_is_yaml_by_default():
    response = Client().get("/api/schema/")

    assert response.status_code == 200
    assert response["Content-Type"] == "application/vnd.oai.openapi; charset=utf-8"
    assert response.content.startswith(b"openapi: 3.")


def test_docs_page_uses_only_local_assets():
    response = Client().get("/api/docs/")

    assert response.status_code == 200
    assert response["Content-Type"] == "text/html; charset=utf-8"
    html = response.content.decode()
    assert "http://" not in html
    assert "https://" not in html
    assets = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert sorted(assets) == [
        "/static/drf_spectacular_sidecar/swagger-ui-dist/favicon-32x32.png",
        "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js",
        "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-standalone-preset.js",
        "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui.css",
    ]
    for asset in assets:
        assert finders.find(asset.removeprefix("/static/")) is not None, asset
    assert 'url: "/api/schema/"' in html
