"""Password guessing is bounded: the login form and the REST API's basic auth count failed
sign-ins per username and address (and per address) in the cache, and past the limit refuse
sign-ins from there (the form's error with 429; DRF's 429 with Retry-After) until the window ends.
New accounts need a password the configured validators accept."""

from __future__ import annotations

import base64
import random

import pytest
from django.contrib.auth import SESSION_KEY
from django.test import Client
from rest_framework.test import APIClient

from marketplace.accounts import services
from marketplace.accounts.errors import WeakPassword
from tests.factories import PASSWORD, db_snapshot

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories"]


@pytest.fixture
def address() -> str:
    """A client address of this test's own: the counts live in the shared cache across runs."""
    return f"10.{random.randrange(256)}.{random.randrange(256)}.{random.randrange(1, 255)}"


@pytest.fixture
def limits(settings):
    settings.SWARM_LOGIN_FAILURES_PER_USER = 3
    settings.SWARM_LOGIN_FAILURES_PER_ADDRESS = 5
    settings.SWARM_LOGIN_WINDOW_S = 300


def basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


def test_the_login_form_refuses_sign_ins_after_too_many_failures(provider, limits, address, fast_password_hashing):
    browser = Client(REMOTE_ADDR=address)
    failures = [browser.post("/login/", {"username": "alice", "password": "wrong"}).status_code for _ in range(3)]

    refused = browser.post("/login/", {"username": "alice", "password": PASSWORD})

    assert failures == [200, 200, 200]
    assert refused.status_code == 429
    assert refused.context["form"].non_field_errors()[0].startswith("Too many failed sign-in attempts. Try again in ")
    assert SESSION_KEY not in browser.session


def test_another_address_still_signs_in(provider, limits, address, fast_password_hashing):
    for _ in range(3):
        Client(REMOTE_ADDR=address).post("/login/", {"username": "alice", "password": "wrong"})
    elsewhere = Client(REMOTE_ADDR=address.rsplit(".", 1)[0] + ".255")  # the fixture's last octet is below 255

    response = elsewhere.post("/login/", {"username": "alice", "password": PASSWORD})

    assert response.status_code == 302
    assert int(elsewhere.session[SESSION_KEY]) == provider.pk


def test_guessing_across_usernames_from_one_address_is_limited(
    provider, second_provider, limits, address, fast_password_hashing
):
    browser = Client(REMOTE_ADDR=address)
    for username in ("alice", "bob", "alice", "bob", "nobody"):
        browser.post("/login/", {"username": username, "password": "wrong"})

    refused = browser.post("/login/", {"username": "bob", "password": PASSWORD})

    assert refused.status_code == 429


def test_a_successful_sign_in_forgets_that_usernames_failures(provider, limits, address, fast_password_hashing):
    browser = Client(REMOTE_ADDR=address)
    for _ in range(2):
        browser.post("/login/", {"username": "alice", "password": "wrong"})
    browser.post("/login/", {"username": "alice", "password": PASSWORD})
    browser.post("/logout/")
    for _ in range(2):
        browser.post("/login/", {"username": "alice", "password": "wrong"})

    response = browser.post("/login/", {"username": "alice", "password": PASSWORD})

    assert response.status_code == 302


def test_basic_auth_answers_429_after_too_many_wrong_passwords(provider, limits, address, fast_password_hashing):
    client = APIClient(REMOTE_ADDR=address)
    wrong = [client.get("/api/v1/nodes/", HTTP_AUTHORIZATION=basic("alice", "wrong")).status_code for _ in range(3)]

    refused = client.get("/api/v1/nodes/", HTTP_AUTHORIZATION=basic("alice", PASSWORD))

    assert wrong == [403, 403, 403]  # DRF answers 403: session auth, listed first, sends no challenge
    assert refused.status_code == 429
    assert refused.json()["detail"].startswith("Too many failed sign-in attempts. Try again in ")
    assert 1 <= int(refused["Retry-After"]) <= 300


def test_basic_auth_with_the_right_password_works_under_the_limit(provider, limits, address, fast_password_hashing):
    client = APIClient(REMOTE_ADDR=address)
    client.get("/api/v1/nodes/", HTTP_AUTHORIZATION=basic("alice", "wrong"))

    response = client.get("/api/v1/nodes/", HTTP_AUTHORIZATION=basic("alice", PASSWORD))

    assert response.status_code == 200
    assert response.json()["results"] == []


@pytest.mark.parametrize(
    ("password", "errors"),
    [
        ("xq7!zr", ["This password is too short. It must contain at least 10 characters."]),
        ("password123", ["This password is too common."]),
        ("4815162342108", ["This password is entirely numeric."]),
        ("frank-frank", ["The password is too similar to the username."]),
    ],
)
def test_signup_refuses_a_weak_password_with_the_reason(password, errors, fast_password_hashing):
    before = db_snapshot()

    response = Client().post(
        "/signup/",
        {
            "username": "frank-frank",
            "email": "frank@example.test",
            "password1": password,
            "password2": password,
            "provider": "on",
        },
    )

    assert response.status_code == 400
    assert response.context["form"].errors == {"password2": errors}
    assert db_snapshot() == before


def test_the_sign_up_service_refuses_a_weak_password(db):
    before = db_snapshot()

    with pytest.raises(WeakPassword) as refused:
        services.sign_up(username="frank", email="f@example.test", password="12345", provider=True, customer=False)

    assert (refused.value.code, refused.value.param) == ("weak_password", "password")
    assert str(refused.value) == (
        "This password is too short. It must contain at least 10 characters. "
        "This password is too common. This password is entirely numeric."
    )
    assert db_snapshot() == before
