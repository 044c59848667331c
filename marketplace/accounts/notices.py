"""Email notices the product promises a provider: a strike opened on one of their nodes (its pending
pay withheld until an admin decides), a strike decided, a payout sent. Each goes to the account's
email address once the transaction that made it true commits, through the configured email backend
(SMTP with EMAIL_HOST; printed to the output otherwise). An email that cannot be sent is logged
and changes nothing else: the dashboards show the same facts."""

from __future__ import annotations

import logging

from django.contrib.auth import get_user_model
from django.core.mail import send_mail
from django.db import transaction

log = logging.getLogger("swarm.accounts")


def notify(user_pk: int, subject: str, body: str) -> None:
    """Email ``body`` to the user once the current transaction commits (at once outside one)."""
    transaction.on_commit(lambda: _deliver(user_pk, subject, body))


def _deliver(user_pk: int, subject: str, body: str) -> None:
    user = get_user_model().objects.filter(pk=user_pk).only("username", "email").first()
    if user is None or not user.email:
        return
    try:
        send_mail(subject, f"Hello {user.username},\n\n{body}\n", None, [user.email])
    except Exception as exc:  # the backend's own (SMTP, socket) errors: the dashboards say the same
        log.warning("could not email %s the notice %r: %r", user.username, subject, exc)
