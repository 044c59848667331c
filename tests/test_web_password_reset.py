"""A forgotten password, reset as a person does it, in a real browser, with the console email
backend of the demo: the sign-in page's link, the email printed with its link, a new password set
through it (the sign-up rules apply), signed in, the old password refused, the link dead after one
use. Around it: an unknown address gets the same page and no email, and one client address may
ask only so often."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.test import Client
from playwright.sync_api import expect

from tests.browser import PASSWORD

pytestmark = [pytest.mark.web, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.browser"]

NEW_PASSWORD = "a-new-and-longer-passphrase-77"
LINK = re.compile(r"http://\S+/reset/[^/\s]+/[^/\s]+/")


@pytest.fixture
def quinn(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    return get_user_model().objects.create_user("quinn", "quinn@example.test", PASSWORD, is_customer=True)


def test_a_forgotten_password_is_reset_through_the_emailed_link(quinn, settings, web, capsys):
    settings.EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"  # the demo's: printed out
    page = web.page
    page.goto("/login/")
    page.get_by_role("link", name="Forgot your password?").click()
    page.get_by_label("Email").fill("Quinn@Example.test")  # as people type it
    page.get_by_role("button", name="Send the link").click()
    expect(page.locator("#reset-sent")).to_contain_text("a link to set a new password is on its way")
    web.shot("1-sent")

    printed = capsys.readouterr().out
    assert "Subject: Reset your password" in printed and "To: quinn@example.test" in printed
    link = LINK.search(printed).group(0)
    assert link.startswith(web.url)

    page.goto(link)
    page.get_by_label("New password", exact=True).fill("password123")  # too common: the sign-up rules apply
    page.get_by_label("New password confirmation").fill("password123")
    page.get_by_role("button", name="Set the password").click()
    expect(page.locator(".errors")).to_contain_text("too common")
    page.get_by_label("New password", exact=True).fill(NEW_PASSWORD)
    page.get_by_label("New password confirmation").fill(NEW_PASSWORD)
    page.get_by_role("button", name="Set the password").click()
    expect(page.locator("#reset-complete")).to_have_text("Your new password is in place and you are signed in.")
    web.shot("2-complete")

    quinn.refresh_from_db()
    assert quinn.check_password(NEW_PASSWORD) and not quinn.check_password(PASSWORD)
    stranger = web.new_session()
    stranger.goto(link)
    expect(stranger.locator("#reset-invalid")).to_contain_text("The link was used already, or it expired.")


def test_an_unknown_address_gets_the_same_page_and_no_email(quinn, settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    mail.outbox.clear()

    response = Client().post("/password-reset/", {"email": "nobody@example.test"}, follow=True)

    assert response.status_code == 200 and b'id="reset-sent"' in response.content
    assert mail.outbox == []


def test_one_address_may_ask_only_so_often(quinn, settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.SWARM_PASSWORD_RESETS_PER_ADDRESS = 2
    settings.SWARM_LOGIN_WINDOW_S = 3600
    mail.outbox.clear()
    client = Client(REMOTE_ADDR="203.0.113.9")

    answers = [client.post("/password-reset/", {"email": "quinn@example.test"}).status_code for _ in range(3)]

    assert answers == [302, 302, 429]
    assert len(mail.outbox) == 2
    refused = client.post("/password-reset/", {"email": "quinn@example.test"}).content.decode()
    assert "Too many password reset requests. Try again in" in refused
