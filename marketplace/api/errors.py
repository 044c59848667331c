"""The HTTP edge of the error vocabulary: each domain error code's HTTP status and OpenAI error
type, and the one function that renders an error as a response.

Every JSON error the control plane answers has OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "amount", "code": "..."}}

How a code is looked up: the error's own code first, then the default codes of its class and of
each base class in turn, so ``JobFailed(..., code="timeout")`` answers as ``job_failed`` does and
``AuthenticationFailed(..., code="revoked_api_key")`` as ``invalid_api_key`` does, each body
still naming its own code. A domain error none of whose codes is listed answers 400
``invalid_request_error`` on purpose: a domain error is a rule the request broke, and a client
can act on 400, while a 500 would page someone for a refusal. Exceptions that are not domain
errors are not rendered here: they propagate and Django answers 500.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from django.http import HttpRequest, HttpResponse, JsonResponse

from marketplace.errors import DomainError
from marketplace.jobs.errors import InvalidRequest, Overloaded, RateLimited


@dataclass(frozen=True)
class HttpError:
    """How one error code answers over HTTP."""

    status: int  # the response's HTTP status code
    type: str  # OpenAI's error "type" field, the class of error an OpenAI client switches on
    public_code: bool = True  # False: the body's "code" is null, as OpenAI sends for a generic invalid request
    # Retry-After (seconds) of a 503, unless the error carries its own: when trying again makes sense.
    retry_after: int | None = None


INVALID = "invalid_request_error"

HTTP_ERRORS: dict[str, HttpError] = {
    # Requests that break a rule or carry a bad input.
    "invalid_request": HttpError(400, INVALID, public_code=False),
    "invalid_json": HttpError(400, INVALID),
    "request_too_large": HttpError(413, INVALID),
    "api_key_name_taken": HttpError(400, INVALID),
    "api_key_limit_reached": HttpError(400, INVALID),
    "weak_password": HttpError(400, INVALID),
    "context_length_exceeded": HttpError(400, INVALID),
    "unknown_parameter": HttpError(400, INVALID),
    "unsupported_parameter": HttpError(400, INVALID),
    "invalid_idempotency_key": HttpError(400, INVALID),
    "idempotency_key_reused": HttpError(400, INVALID),
    "idempotency_key_in_use": HttpError(409, INVALID),
    "email_taken": HttpError(400, INVALID),
    "invalid_webhook_payload": HttpError(400, INVALID),
    "invalid_webhook_signature": HttpError(400, INVALID),
    "key_already_registered": HttpError(400, INVALID),
    "invalid_handshake": HttpError(400, INVALID),
    "invalid_report": HttpError(400, INVALID),
    "method_not_allowed": HttpError(405, INVALID),
    "model_not_found": HttpError(404, INVALID),
    "not_found": HttpError(404, INVALID),
    "catalog_not_found": HttpError(404, INVALID),
    # Who is asking.
    "invalid_api_key": HttpError(401, "authentication_error"),
    "not_signed_in": HttpError(401, "authentication_error"),
    "not_a_customer": HttpError(403, INVALID),
    "role_required": HttpError(403, INVALID),
    "invalid_join_token": HttpError(403, INVALID),
    "node_not_allowed": HttpError(403, INVALID),
    "trust_mark_refused": HttpError(400, INVALID),
    "payout_refused": HttpError(403, INVALID),
    "strike_decision_refused": HttpError(403, INVALID),
    # Money and limits.
    "insufficient_quota": HttpError(402, "insufficient_quota"),
    "top_up_refused": HttpError(402, "payment_error"),
    "rate_limit_exceeded": HttpError(429, "rate_limit_error"),
    # The service's side.
    "job_failed": HttpError(500, "server_error"),
    # Every 503 says when to come back: a model without a ready pipeline gets one as nodes load or
    # heal (seconds to a minute); trusted nodes are fewer; Stripe's outages pass in minutes; a server
    # without a payment provider or webhook secret needs its operator.
    "no_capacity": HttpError(503, "service_unavailable", retry_after=10),
    "overloaded": HttpError(503, "service_unavailable", retry_after=2),
    "no_trusted_capacity": HttpError(503, "service_unavailable", retry_after=30),
    "payment_provider_unavailable": HttpError(503, "service_unavailable", retry_after=60),
    "webhook_not_configured": HttpError(503, "service_unavailable", retry_after=3600),
}
UNKNOWN = HttpError(400, INVALID)  # see the module docstring for why 400


def http_error(exc: DomainError) -> HttpError:
    """The status and OpenAI type of ``exc``: its own code's, else its classes' default codes'."""
    codes = [exc.code, *(vars(cls)["code"] for cls in type(exc).__mro__ if "code" in vars(cls))]
    for code in codes:
        if code in HTTP_ERRORS:
            return HTTP_ERRORS[code]
    return UNKNOWN


def error_body(exc: DomainError) -> dict:
    """OpenAI's error object for ``exc`` (also the payload of a failed stream's last SSE event)."""
    code = exc.code if http_error(exc).public_code else None
    return {"error": {"message": str(exc), "type": http_error(exc).type, "param": exc.param, "code": code}}


def error_response(exc: DomainError, *, request_id: str | None = None) -> JsonResponse:
    """The one JSON error response: OpenAI's body, the code's status, and the headers clients
    act on (Retry-After on 429 and every 503, the x-ratelimit-* limits on 429, x-should-retry: false
    on 402)."""
    mapped = http_error(exc)
    response = JsonResponse(error_body(exc), status=mapped.status)
    if request_id is not None:
        response["x-request-id"] = request_id
    if mapped.status == 402:  # more credits are needed first: the OpenAI SDKs must not retry
        response["x-should-retry"] = "false"
    retry_after = exc.retry_after if isinstance(exc, Overloaded | RateLimited) else mapped.retry_after
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    if isinstance(exc, RateLimited):
        for name, value in exc.headers.items():
            response[name] = value
    return response


def renders_domain_errors(view: Callable) -> Callable:
    """Answer a domain error raised by ``view`` (sync or async) with ``error_response``."""
    if inspect.iscoroutinefunction(view):

        @functools.wraps(view)
        async def wrapped_async(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            try:
                return await view(request, *args, **kwargs)
            except DomainError as exc:
                return error_response(exc)

        return wrapped_async

    @functools.wraps(view)
    def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        try:
            return view(request, *args, **kwargs)
        except DomainError as exc:
            return error_response(exc)

    return wrapped


def allow_method(method: str) -> Callable:
    """Answer a request made with any other method than ``method`` 405 in the error shape, before
    the (async) view and its authentication run."""

    def decorator(view: Callable) -> Callable:
        @functools.wraps(view)
        async def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if request.method != method:
                return error_response(InvalidRequest(f"Use {method}.", code="method_not_allowed"))
            return await view(request, *args, **kwargs)

        return wrapped

    return decorator
