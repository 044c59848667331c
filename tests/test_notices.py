"""The notices the product promises a provider, by email too (the console backend in the demo,
SMTP in production): a strike on their node when it opens, its decision, a payout sent. Each goes
once its transaction commits, to the account's address; one that cannot be sent changes nothing."""

from __future__ import annotations

import pytest

from marketplace.accounts import notices
from marketplace.verification.models import StrikeKind
from marketplace.verification.strikes import open_strike, overturn_strike, uphold_strike
from tests.payout_fixtures import CENT, pay

pytest_plugins = ["tests.factories", "tests.stripe_fake", "tests.payout_fixtures"]
pytestmark = [pytest.mark.trust, pytest.mark.django_db]


@pytest.fixture
def node(provider, make_joined_node):
    return make_joined_node(provider, "gpu-7").node


def strike_on(node, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        return open_strike(node, StrikeKind.CAPACITY, evidence={"reason": "claimed 40x the speed it was measured at"})


def test_a_strike_on_a_node_emails_its_owner(node, provider, mailoutbox, django_capture_on_commit_callbacks):
    strike_on(node, django_capture_on_commit_callbacks)

    [email] = mailoutbox
    assert (email.to, email.subject) == ([provider.email], "A strike on your node gpu-7")
    assert "failed a check: claimed 40x the speed it was measured at" in email.body
    assert "pending pay is withheld until an admin decides" in email.body


@pytest.mark.parametrize("decision", ["uphold", "overturn"])
def test_a_strikes_decision_emails_the_owner(
    decision, node, provider, admin, mailoutbox, django_capture_on_commit_callbacks
):
    strike = strike_on(node, django_capture_on_commit_callbacks)
    mailoutbox.clear()
    with django_capture_on_commit_callbacks(execute=True):
        if decision == "uphold":
            uphold_strike(strike, by=admin, reason="the output was wrong")
        else:
            overturn_strike(strike, by=admin, reason="a bad reference")

    [email] = mailoutbox
    assert (email.to, email.subject) == ([provider.email], "The strike on your node gpu-7 was decided")
    if decision == "uphold":
        assert "was upheld: the output was wrong. $0.00 of its pending pay was clawed back." in email.body
    else:
        assert "was overturned: a bad reference. Its withheld pay is released." in email.body


def test_a_payout_sent_emails_the_provider(earn, connected, admin, mailoutbox, django_capture_on_commit_callbacks):
    earn(3 * CENT + 4_000_000)
    with django_capture_on_commit_callbacks(execute=True):
        payout = pay(admin)

    sent = [email for email in mailoutbox if email.subject.startswith("Payout sent")]
    assert [(email.to, email.subject) for email in sent] == [([connected.email], "Payout sent: $0.03")]
    assert f"(transfer {payout.stripe_transfer_id})" in sent[0].body


def test_a_notice_that_cannot_be_sent_is_logged_and_changes_nothing(
    provider, settings, caplog, django_capture_on_commit_callbacks
):
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", 9, 2  # nothing listens

    with django_capture_on_commit_callbacks(execute=True):
        notices.notify(provider.pk, "A subject", "A body")

    assert any("could not email alice the notice 'A subject'" in message for message in caplog.messages)
