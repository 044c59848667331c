"""Account use cases: sign-up, roles, and the limit on failed sign-ins."""

from __future__ import annotations

import hashlib
import time

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.db import transaction

from marketplace.accounts.errors import EmailTaken, RoleRequired, TooManyLoginAttempts, WeakPassword


@transaction.atomic
def sign_up(*, username: str, email: str, password: str, provider: bool, customer: bool):
    """Create a user holding the chosen roles (at least one), under an email no other account
    uses (compared without case; kept in lower case), with a password the configured validators
    accept (``WeakPassword`` lists what they refused)."""
    if not (provider or customer):
        raise RoleRequired("Choose at least one role: provider or customer.")
    email = check_email_free(email)
    try:
        validate_password(password, user=get_user_model()(username=username, email=email))
    except ValidationError as exc:
        raise WeakPassword(" ".join(exc.messages), param="password") from None
    user = get_user_model().objects.create_user(
        username=username, email=email, password=password, is_provider=provider, is_customer=customer
    )
    return user


def check_email_free(email: str, *, user_pk: int | None = None) -> str:
    """The address in lower case, as accounts keep it; ``EmailTaken`` when another account (any but
    ``user_pk``'s) already uses it, compared without case. The sign-up form and the Django admin's
    user forms both check through here."""
    email = email.strip().lower()
    others = get_user_model().objects.filter(email__iexact=email)
    if user_pk is not None:
        others = others.exclude(pk=user_pk)
    if others.exists():
        raise EmailTaken("An account with this email already exists.", param="email")
    return email


@transaction.atomic
def add_role(user, *, provider: bool = False, customer: bool = False) -> None:
    fields = []
    if provider and not user.is_provider:
        user.is_provider = True
        fields.append("is_provider")
    if customer and not user.is_customer:
        user.is_customer = True
        fields.append("is_customer")
    if fields:
        user.save(update_fields=fields)


# --- failed sign-ins ------------------------------------------------------------------------------
# Counted in fixed windows of SWARM_LOGIN_WINDOW_S in the cache (Redis in production, so every
# web process shares them): per username and client address (SWARM_LOGIN_FAILURES_PER_USER), and
# per address across usernames (SWARM_LOGIN_FAILURES_PER_ADDRESS). The login form and the API's
# basic auth check and count the same way.


def _failure_keys(username: str, address: str, window: int) -> tuple[str, str]:
    who = hashlib.sha256(f"{username.strip().lower()}\0{address}".encode()).hexdigest()[:32]
    return f"login-fail:user:{who}:{window}", f"login-fail:addr:{address}:{window}"


def _window(now: float | None) -> tuple[int, int]:
    """The current window's number and the seconds until it ends (at least 1)."""
    now = time.time() if now is None else now
    length = settings.SWARM_LOGIN_WINDOW_S
    window = int(now // length)
    return window, max(1, int((window + 1) * length - now))


def check_login_allowed(username: str, address: str, *, now: float | None = None) -> None:
    """Refuse (``TooManyLoginAttempts``, with the seconds to wait) a sign-in from ``address`` as
    ``username`` after too many failures in the current window; allowed otherwise."""
    window, wait = _window(now)
    user_key, address_key = _failure_keys(username, address, window)
    counts = cache.get_many([user_key, address_key])
    if (
        counts.get(user_key, 0) >= settings.SWARM_LOGIN_FAILURES_PER_USER
        or counts.get(address_key, 0) >= settings.SWARM_LOGIN_FAILURES_PER_ADDRESS
    ):
        raise TooManyLoginAttempts(f"Too many failed sign-in attempts. Try again in {wait} seconds.", retry_after=wait)


def record_login_failure(username: str, address: str, *, now: float | None = None) -> None:
    """Count one failed sign-in from ``address`` as ``username``."""
    window, _ = _window(now)
    for key in _failure_keys(username, address, window):
        cache.add(key, 0, timeout=settings.SWARM_LOGIN_WINDOW_S * 2)
        cache.incr(key)


def _reset_key(address: str, window: int) -> str:
    return f"password-reset:addr:{address}:{window}"


def check_reset_allowed(address: str, *, now: float | None = None) -> None:
    """Refuse (``TooManyLoginAttempts``, with the seconds to wait) one more password reset email
    asked for from ``address`` past SWARM_PASSWORD_RESETS_PER_ADDRESS in the current window, and
    count this one otherwise."""
    window, wait = _window(now)
    key = _reset_key(address, window)
    if (cache.get(key) or 0) >= settings.SWARM_PASSWORD_RESETS_PER_ADDRESS:
        raise TooManyLoginAttempts(f"Too many password reset requests. Try again in {wait} seconds.", retry_after=wait)
    cache.add(key, 0, timeout=settings.SWARM_LOGIN_WINDOW_S * 2)
    cache.incr(key)


def clear_login_failures(username: str, address: str, *, now: float | None = None) -> None:
    """A sign-in succeeded: forget this username's failures from ``address`` (the address's own
    count stays, so signing in to one account does not reset guessing at others)."""
    window, _ = _window(now)
    cache.delete(_failure_keys(username, address, window)[0])
