"""Users and their roles: a provider owns nodes, a customer buys tokens, staff are admins.
One user may be both provider and customer."""

from __future__ import annotations

from django.contrib.auth.models import AbstractUser
from django.db import models


class User(AbstractUser):
    email = models.EmailField(unique=True)
    is_provider = models.BooleanField(default=False, help_text="owns nodes and is paid for verified work")
    is_customer = models.BooleanField(default=False, help_text="buys inference per token")

    @property
    def is_admin(self) -> bool:
        return self.is_staff

    @property
    def roles(self) -> list[str]:
        return [
            role
            for role, held in (("provider", self.is_provider), ("customer", self.is_customer), ("admin", self.is_staff))
            if held
        ]
