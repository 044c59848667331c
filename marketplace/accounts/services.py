"""Account use cases."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import transaction

from marketplace.accounts.errors import EmailTaken, RoleRequired


@transaction.atomic
def sign_up(*, username: str, email: str, password: str, provider: bool, customer: bool):
    """Create a user holding the chosen roles (at least one), under an email no other account
    uses (compared without case; kept in lower case)."""
    if not (provider or customer):
        raise RoleRequired("Choose at least one role: provider or customer.")
    email = email.lower()
    if get_user_model().objects.filter(email__iexact=email).exists():
        raise EmailTaken("An account with this email already exists.", param="email")
    user = get_user_model().objects.create_user(
        username=username, email=email, password=password, is_provider=provider, is_customer=customer
    )
    return user


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
