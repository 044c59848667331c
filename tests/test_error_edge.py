"""The HTTP edge of the error vocabulary: each code's status and OpenAI type, the one error body,
its headers, the bearer-key decorator, and the dashboard showing a service's refusal."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from django.test import Client, RequestFactory

from marketplace.accounts.errors import RoleRequired
from marketplace.api.auth import api_key_required
from marketplace.api.errors import HTTP_ERRORS, HttpError, error_body, error_response, http_error, renders_domain_errors
from marketplace.billing.errors import TopUpRefused
from marketplace.errors import DomainError
from marketplace.jobs.errors import AuthenticationFailed, InvalidRequest, JobFailed, Overloaded, RateLimited
from marketplace.jobs.models import ApiKey
from marketplace.jobs.services import create_api_key
from tests.factories import db_snapshot

pytestmark = pytest.mark.api
pytest_plugins = ["tests.factories"]


def body_of(response) -> dict:
    return json.loads(response.content)


def test_a_generic_invalid_request_answers_400_with_a_null_code():
    exc = InvalidRequest("'seed' must be an integer.", param="seed")

    assert http_error(exc) == HttpError(400, "invalid_request_error", public_code=False)
    assert error_body(exc) == {
        "error": {
            "message": "'seed' must be an integer.",
            "type": "invalid_request_error",
            "param": "seed",
            "code": None,
        }
    }


def test_a_finer_code_answers_as_its_class_does_and_keeps_its_name():
    revoked = AuthenticationFailed("This API key was revoked.", code="revoked_api_key")
    timed_out = JobFailed("The job failed: the job stopped answering", code="timeout")

    assert (http_error(revoked).status, error_body(revoked)["error"]["code"]) == (401, "revoked_api_key")
    assert (http_error(timed_out).status, http_error(timed_out).type) == (500, "server_error")
    assert error_body(timed_out)["error"]["code"] == "timeout"


def test_a_listed_finer_code_wins_over_its_class():
    exc = InvalidRequest("Use POST.", code="method_not_allowed")

    assert (http_error(exc).status, error_body(exc)["error"]["code"]) == (405, "method_not_allowed")


def test_an_unlisted_domain_code_answers_400():
    class Novel(DomainError):
        code = "novel_rule"

    response = error_response(Novel("a rule nobody mapped"))

    assert response.status_code == 400
    assert body_of(response) == {
        "error": {
            "message": "a rule nobody mapped",
            "type": "invalid_request_error",
            "param": None,
            "code": "novel_rule",
        }
    }


def test_a_rate_limit_answers_429_with_retry_after_and_its_limits():
    limits = {"x-ratelimit-limit-requests": "1", "x-ratelimit-remaining-requests": "0"}
    exc = RateLimited(
        "Rate limit reached for requests per minute (limit 1); retry in 7s.", retry_after=7, headers=limits
    )

    response = error_response(exc, request_id="req_1")

    assert response.status_code == 429
    assert (response["Retry-After"], response["x-ratelimit-limit-requests"]) == ("7", "1")
    assert (response["x-ratelimit-remaining-requests"], response["x-request-id"]) == ("0", "req_1")
    assert body_of(response)["error"]["type"] == "rate_limit_error"


def test_a_payment_refusal_answers_402_and_tells_sdks_not_to_retry():
    response = error_response(TopUpRefused("The payment provider refused this top-up (card_declined)."))

    assert (response.status_code, response["x-should-retry"]) == (402, "false")
    assert body_of(response)["error"] == {
        "message": "The payment provider refused this top-up (card_declined).",
        "type": "payment_error",
        "param": None,
        "code": "top_up_refused",
    }


def test_a_view_raising_a_domain_error_is_answered_in_the_error_shape():
    @renders_domain_errors
    def view(request):
        raise RoleRequired("only customers can top up credits")

    response = view(RequestFactory().get("/"))

    assert response.status_code == 403
    assert body_of(response)["error"]["code"] == "role_required"


@pytest.mark.django_db
def test_the_key_decorator_hands_sync_and_async_views_the_callers_key(customer):
    api_key, key = create_api_key(customer, "laptop")
    request = RequestFactory().get("/", HTTP_AUTHORIZATION=f"Bearer {key}")

    @api_key_required
    def sync_view(request, api_key):
        return api_key

    @api_key_required
    async def async_view(request, api_key):
        return api_key

    assert sync_view(request) == api_key
    assert async_to_sync(async_view)(request) == api_key  # its ORM call runs on this thread, in the test's transaction
    assert sync_view(request).user == customer


@pytest.mark.django_db
def test_the_key_decorator_refuses_a_missing_key_before_the_view_runs():
    ran = []

    @api_key_required
    def view(request, api_key):
        ran.append(api_key)

    response = view(RequestFactory().get("/"))

    assert response.status_code == 401
    assert body_of(response) == {
        "error": {
            "message": "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert ran == []


@pytest.mark.django_db
def test_the_dashboard_shows_the_services_refusal_of_a_duplicate_key_name(customer):
    create_api_key(customer, "laptop")
    browser = Client()
    browser.force_login(customer)
    before = db_snapshot()

    response = browser.post("/customer/keys/", {"name": "laptop"})

    assert response.status_code == 400
    assert response.context["form"].errors == {"name": ["You already have an active key with this name."]}
    assert db_snapshot() == before
    assert ApiKey.objects.filter(user=customer).count() == 1


@pytest.mark.parametrize("code", sorted(code for code, mapped in HTTP_ERRORS.items() if mapped.status == 503))
def test_every_503_says_when_to_come_back(code):
    response = error_response(DomainError("Not now.", code=code))

    assert response.status_code == 503
    assert int(response["Retry-After"]) >= 1


def test_an_overloaded_model_says_its_own_retry_after():
    response = error_response(Overloaded("Full; retry shortly.", retry_after=3))

    assert (response.status_code, response["Retry-After"]) == (503, "3")
