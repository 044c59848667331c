"""Errors of the inference API's use cases: keys, admission, rate limits, jobs.

Codes follow OpenAI's where OpenAI has one, so an OpenAI client recognises them; the HTTP
status and OpenAI error type of each are chosen at the edge (``marketplace.api.errors``).
"""

from __future__ import annotations

from marketplace.errors import DomainError


class ApiError(DomainError):
    """The jobs app's base error."""

    code = "api_error"


class InvalidRequest(ApiError):
    """The request itself is wrong (a malformed or out-of-range input, a rule it breaks)."""

    code = "invalid_request"


class AuthenticationFailed(ApiError):
    """No key, an unknown or revoked key, or a disabled account."""

    code = "invalid_api_key"


class ModelNotFound(ApiError):
    code = "model_not_found"


class RateLimited(ApiError):
    """A key's per-minute request or token limit would be passed; the request was not counted."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: int, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds until the current window ends
        self.headers = headers  # the x-ratelimit-* limits, remainders and resets to report with the refusal


class NoCapacity(ApiError):
    code = "no_capacity"


class NoTrustedCapacity(NoCapacity):
    """The request asked for trusted nodes (``Privacy``) and no route of such nodes is ready, while
    others are: it is refused, never sent to them."""

    code = "no_trusted_capacity"


class Overloaded(NoCapacity):
    """Every route of the model carries as many jobs as its stages hold, and none freed up while
    the request waited (SWARM_QUEUE_WAIT_S)."""

    code = "overloaded"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class JobFailed(ApiError):
    """An admitted job ended in error; the instance's code is the failure's (e.g. ``timeout``)."""

    code = "job_failed"


class ApiKeyNameTaken(InvalidRequest):
    """The customer already has an active key of that name, or the name is kept for the playground."""

    code = "api_key_name_taken"


class ApiKeyLimitReached(InvalidRequest):
    """The customer already has SWARM_API_KEYS_PER_ACCOUNT active keys; one must be revoked first."""

    code = "api_key_limit_reached"


class JobNotFound(ApiError):
    """No job of the calling customer has that id."""

    code = "not_found"
