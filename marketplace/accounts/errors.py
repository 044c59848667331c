"""Errors of the accounts app (sign-up, roles)."""

from __future__ import annotations

from marketplace.errors import DomainError


class AccountError(DomainError):
    code = "account"


class RoleRequired(AccountError):
    """The account lacks the role the use case needs, or a sign-up chose no role."""

    code = "role_required"


class EmailTaken(AccountError):
    """Another account already uses this email address (compared without case)."""

    code = "email_taken"
