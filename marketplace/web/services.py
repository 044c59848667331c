"""The dashboards' own small use cases, built on the other apps' services."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import transaction

from marketplace.jobs.models import ApiKey
from marketplace.jobs.services import create_playground_key
from marketplace.web.selectors import playground_key


@transaction.atomic
def ensure_playground_key(user) -> ApiKey:
    """The customer's playground key, created on first use (and again after they revoke it).

    The playground calls the API on the customer's behalf with the key's row, never its secret,
    so the plaintext that creation returns is dropped: nobody can use this key from outside.
    The user's row is locked so that two first requests at once create one key.
    """
    get_user_model().objects.select_for_update().filter(pk=user.pk).first()
    found = playground_key(user)
    if found is not None:
        return found
    api_key, _ = create_playground_key(user)
    return api_key
