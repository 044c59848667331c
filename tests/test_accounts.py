"""Accounts: sign-up with roles (/signup/), sign-in (/login/), sign-out (/logout/), home (/)."""

from __future__ import annotations

import pytest
from django.contrib.auth import SESSION_KEY, get_user_model
from django.test import Client

from tests.factories import PASSWORD, db_snapshot

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories"]

ROLE_REQUIRED = "Choose at least one role: provider or customer."


def signup_form(**overrides) -> dict:
    return {
        "username": "frank",
        "email": "frank@example.test",
        "password1": PASSWORD,
        "password2": PASSWORD,
        "provider": "on",
        "customer": "",
    } | overrides


@pytest.fixture
def browser(fast_password_hashing) -> Client:
    return Client()


def signed_in_user_id(client: Client) -> int | None:
    value = client.session.get(SESSION_KEY)
    return None if value is None else int(value)


def test_signup_page_shows_labelled_fields(browser):
    response = browser.get("/signup/")

    assert response.status_code == 200
    html = response.content.decode()
    for field, label in [
        ("username", "Username"),
        ("email", "Email"),
        ("password1", "Password"),
        ("password2", "Password confirmation"),
        ("provider", "I provide GPUs (provider)"),
        ("customer", "I buy inference (customer)"),
    ]:
        assert f'<label for="id_{field}">{label}</label>' in html
        assert f'id="id_{field}"' in html
    assert 'type="checkbox" name="provider"' in html
    assert 'type="checkbox" name="customer"' in html


@pytest.mark.parametrize(
    ("roles", "expected"),
    [
        ({"provider": "on", "customer": ""}, (True, False)),
        ({"provider": "", "customer": "on"}, (False, True)),
        ({"provider": "on", "customer": "on"}, (True, True)),
    ],
)
def test_signup_creates_a_user_with_the_chosen_roles_and_signs_in(roles, expected, browser):
    response = browser.post("/signup/", signup_form(**roles))

    assert response.status_code == 302
    assert response["Location"] == "/"
    user = get_user_model().objects.get()
    assert (user.username, user.email) == ("frank", "frank@example.test")
    assert (user.is_provider, user.is_customer, user.is_staff) == (*expected, False)
    assert user.check_password(PASSWORD)
    assert signed_in_user_id(browser) == user.pk


def test_signup_stores_the_email_in_lowercase(browser):
    response = browser.post("/signup/", signup_form(email="Frank@Example.TEST"))

    assert response.status_code == 302
    assert get_user_model().objects.get().email == "frank@example.test"


def test_signup_without_a_role_is_refused_with_the_error_shown(browser):
    before = db_snapshot()

    response = browser.post("/signup/", signup_form(provider="", customer=""))

    assert response.status_code == 400
    assert ROLE_REQUIRED in response.content.decode()
    assert response.context["form"].non_field_errors() == [ROLE_REQUIRED]
    assert db_snapshot() == before
    assert signed_in_user_id(browser) is None


@pytest.mark.parametrize("email", ["carol@example.test", "CAROL@example.test"])
def test_signup_with_an_email_already_in_use_is_refused(email, customer, browser):
    before = db_snapshot()

    response = browser.post("/signup/", signup_form(email=email))

    assert response.status_code == 400
    assert response.context["form"].errors == {"email": ["An account with this email already exists."]}
    assert "An account with this email already exists." in response.content.decode()
    assert db_snapshot() == before


def test_signup_refuses_the_password_1234_with_every_reason(browser):
    before = db_snapshot()

    response = browser.post("/signup/", signup_form(password1="1234", password2="1234"))

    assert response.status_code == 400
    assert response.context["form"].errors == {
        "password2": [
            "This password is too short. It must contain at least 10 characters.",
            "This password is too common.",
            "This password is entirely numeric.",
        ]
    }
    assert "This password is too short. It must contain at least 10 characters." in response.content.decode()
    assert db_snapshot() == before
    assert signed_in_user_id(browser) is None


@pytest.mark.parametrize(
    ("email", "error"),
    [
        ("", "This field is required."),
        ("frank@", "Enter a valid email address."),
        ("frank", "Enter a valid email address."),
    ],
)
def test_signup_needs_a_well_formed_email(email, error, browser):
    before = db_snapshot()

    response = browser.post("/signup/", signup_form(email=email))

    assert response.status_code == 400
    assert response.context["form"].errors == {"email": [error]}
    assert error in response.content.decode()
    assert db_snapshot() == before


def test_signup_with_a_username_already_in_use_is_refused(customer, browser):
    before = db_snapshot()

    response = browser.post("/signup/", signup_form(username="carol"))

    assert response.status_code == 400
    assert response.context["form"].errors == {"username": ["A user with that username already exists."]}
    assert db_snapshot() == before


def test_signup_with_mismatched_passwords_is_refused(browser):
    before = db_snapshot()

    response = browser.post("/signup/", signup_form(password2=PASSWORD + "x"))

    assert response.status_code == 400
    assert response.context["form"].errors == {"password2": ["The two password fields didn’t match."]}
    assert db_snapshot() == before


def test_signup_answers_only_get_and_post(browser):
    response = browser.put("/signup/")

    assert response.status_code == 405


def test_login_with_the_right_password_signs_in_and_goes_home(provider, browser):
    response = browser.post("/login/", {"username": "alice", "password": PASSWORD})

    assert response.status_code == 302
    assert response["Location"] == "/"
    assert signed_in_user_id(browser) == provider.pk


def test_login_with_a_wrong_password_is_refused(provider, browser):
    response = browser.post("/login/", {"username": "alice", "password": "wrong"})

    assert response.status_code == 200
    assert signed_in_user_id(browser) is None
    assert "Please enter a correct username and password." in response.content.decode()


def test_logout_signs_out_and_goes_to_login(provider, browser):
    browser.force_login(provider)

    response = browser.post("/logout/")

    assert response.status_code == 302
    assert response["Location"] == "/login/"
    assert signed_in_user_id(browser) is None


def test_logout_by_get_is_not_allowed(provider, browser):
    browser.force_login(provider)

    response = browser.get("/logout/")

    assert response.status_code == 405
    assert signed_in_user_id(browser) == provider.pk


def test_home_shows_visitors_the_front_door(browser):
    response = browser.get("/")

    assert response.status_code == 200
    assert response.templates[0].name == "web/landing.html"
    assert signed_in_user_id(browser) is None


def test_home_shows_a_providers_roles_and_nodes_section(make_user, browser):
    user = make_user("grace", provider=True, customer=True)
    browser.force_login(user)

    response = browser.get("/")

    assert response.status_code == 200
    html = response.content.decode()
    assert "<h1>Welcome, grace</h1>" in html
    assert "Your roles: provider, customer." in html
    assert "<h2>Your nodes</h2>" in html


def test_home_shows_no_nodes_section_to_a_customer(customer, browser):
    browser.force_login(customer)

    response = browser.get("/")

    assert response.status_code == 200
    html = response.content.decode()
    assert "Your roles: customer." in html
    assert "Your nodes" not in html


def test_home_names_the_admin_role(admin, browser):
    browser.force_login(admin)

    response = browser.get("/")

    assert "Your roles: admin." in response.content.decode()


def test_home_says_none_for_a_user_without_roles(stranger, browser):
    browser.force_login(stranger)

    response = browser.get("/")

    assert "Your roles: none." in response.content.decode()
