"""The REST API's list pagination: DRF's limit/offset, with both refused (400) past their bounds,
where an unbounded number would reach the database as an out-of-range LIMIT or OFFSET."""

from __future__ import annotations

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination

MAX_LIMIT = 1000  # the most rows one page may ask for
MAX_OFFSET = 10**9  # far past any list here, far below the database's integer limits


def _bounded(request, name: str, high: int, default: int | None) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError({name: [f"'{name}' must be a whole number."]}) from None
    low = 1 if name == "limit" else 0
    if not low <= value <= high:
        raise ValidationError({name: [f"'{name}' must be between {low} and {high}, got {raw}."]})
    return value


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    max_limit = MAX_LIMIT

    def get_limit(self, request) -> int | None:
        return _bounded(request, self.limit_query_param, MAX_LIMIT, self.default_limit)

    def get_offset(self, request) -> int:
        return _bounded(request, self.offset_query_param, MAX_OFFSET, 0) or 0
