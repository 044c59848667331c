"""The Django admin's "Add user" form (/admin/accounts/user/add/): it asks for the email, which no
other account may use in any case, and for a password the validators accept."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests.factories import PASSWORD, db_snapshot

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories"]

ADD_URL = "/admin/accounts/user/add/"


def add_form(**overrides) -> dict:
    return {
        "username": "heidi",
        "email": "heidi@example.test",
        "usable_password": "true",
        "password1": PASSWORD,
        "password2": PASSWORD,
        "is_provider": "on",
    } | overrides


@pytest.fixture
def admin_browser(django_user_model, fast_password_hashing) -> Client:
    browser = Client()
    browser.force_login(django_user_model.objects.create_superuser("root", "root@example.test", PASSWORD))
    return browser


def test_the_add_user_page_asks_for_the_email_and_the_roles(admin_browser):
    response = admin_browser.get(ADD_URL)

    assert response.status_code == 200
    adminform = response.context["adminform"]
    assert [field.field.name for fieldset in adminform for line in fieldset for field in line] == [
        "username",
        "email",
        "usable_password",
        "password1",
        "password2",
        "is_provider",
        "is_customer",
    ]
    assert adminform.form.fields["email"].required


def test_an_admin_adds_two_users_one_after_the_other(admin_browser):
    first = admin_browser.post(ADD_URL, add_form())
    second = admin_browser.post(ADD_URL, add_form(username="ivan", email="Ivan@Example.TEST", is_provider=""))

    assert (first.status_code, second.status_code) == (302, 302)
    users = get_user_model().objects.filter(username__in=["heidi", "ivan"]).order_by("username")
    assert [(u.username, u.email, u.is_provider, u.is_customer, u.is_staff) for u in users] == [
        ("heidi", "heidi@example.test", True, False, False),
        ("ivan", "ivan@example.test", False, False, False),
    ]
    assert users[0].check_password(PASSWORD)
    assert second["Location"] == f"/admin/accounts/user/{users[1].pk}/change/"


@pytest.mark.parametrize("email", ["carol@example.test", "CAROL@Example.test"])
def test_adding_a_user_with_an_email_in_use_is_refused_on_the_form(email, customer, admin_browser):
    before = db_snapshot()

    response = admin_browser.post(ADD_URL, add_form(email=email))

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {"email": ["An account with this email already exists."]}
    assert db_snapshot() == before


def test_adding_a_user_without_an_email_is_refused_on_the_form(admin_browser):
    before = db_snapshot()

    response = admin_browser.post(ADD_URL, add_form(email=""))

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {"email": ["This field is required."]}
    assert db_snapshot() == before


def test_adding_a_user_with_the_password_1234_is_refused_on_the_form(admin_browser):
    before = db_snapshot()

    response = admin_browser.post(ADD_URL, add_form(password1="1234", password2="1234"))

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "password2": [
            "This password is too short. It must contain at least 10 characters.",
            "This password is too common.",
            "This password is entirely numeric.",
        ]
    }
    assert db_snapshot() == before


def test_changing_a_users_email_to_one_in_use_is_refused(customer, provider, admin_browser):
    page = admin_browser.get(f"/admin/accounts/user/{provider.pk}/change/")
    form = page.context["adminform"].form
    data = {name: value for name, value in form.initial.items() if value is not None and name != "password"}
    data |= {"email": "Carol@example.test", "date_joined_0": "2025-01-01", "date_joined_1": "00:00:00"}
    data = {k: v for k, v in data.items() if k not in ("groups", "user_permissions", "last_login", "date_joined")}
    before = db_snapshot()

    response = admin_browser.post(f"/admin/accounts/user/{provider.pk}/change/", data)

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {"email": ["An account with this email already exists."]}
    assert db_snapshot() == before
