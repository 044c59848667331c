"""Errors of the accounts app (sign-up, roles)."""

from __future__ import annotations

from marketplace.errors import DomainError


class AccountError(DomainError):
    code = "account"


class RoleRequired(AccountError):
    """The account lacks the role the use case needs, or a sign-up chose no role."""

    code = "role_required"


class WeakPassword(AccountError):
    """The password fails the configured validators (AUTH_PASSWORD_VALIDATORS); the message lists why."""

    code = "weak_password"


class TooManyLoginAttempts(AccountError):
    """Too many failed sign-ins for this username or address within the window; ``retry_after`` in seconds."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EmailTaken(AccountError):
    """Another account already uses this email address (compared without case)."""

    code = "email_taken"
