"""Error codes of the accounts app."""

from __future__ import annotations


class AccountError(Exception):
    code = "account"


class RoleRequired(AccountError):
    code = "role_required"
