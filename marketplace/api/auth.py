"""Authentication at the HTTP edge.

Bearer API keys: one decorator authenticates ``Authorization: Bearer <key>`` and hands the view
the key, so no view repeats the preamble.

    @api_key_required
    async def credits(request, api_key): ...

A request without an active key is answered 401 in OpenAI's error shape before the view runs.

HTTP basic auth of the REST API (``ThrottledBasicAuthentication``) counts failed passwords as the
login form does (``accounts.services``): past the limit it answers 429 with Retry-After.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from drf_spectacular.authentication import BasicScheme
from rest_framework import exceptions
from rest_framework.authentication import BasicAuthentication

from marketplace.accounts import services as accounts
from marketplace.accounts.errors import TooManyLoginAttempts
from marketplace.api.errors import error_response
from marketplace.jobs import services
from marketplace.jobs.errors import AuthenticationFailed


def api_key_required(view: Callable) -> Callable:
    """Call ``view(request, api_key, *args, **kwargs)`` with the request's active key (its
    customer is ``api_key.user``); sync and async views alike."""
    if inspect.iscoroutinefunction(view):

        @functools.wraps(view)
        async def wrapped_async(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            header = request.headers.get("Authorization")
            try:
                api_key = await sync_to_async(services.authenticate_key)(header)
            except AuthenticationFailed as exc:
                return error_response(exc)
            return await view(request, api_key, *args, **kwargs)

        return wrapped_async

    @functools.wraps(view)
    def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        try:
            api_key = services.authenticate_key(request.headers.get("Authorization"))
        except AuthenticationFailed as exc:
            return error_response(exc)
        return view(request, api_key, *args, **kwargs)

    return wrapped


class ThrottledBasicAuthentication(BasicAuthentication):
    """DRF's basic auth, refused with 429 (DRF's ``Throttled``, with Retry-After) after too many
    failed passwords from the client's address, as the login form refuses them."""

    def authenticate_credentials(self, userid, password, request=None):
        address = request.META.get("REMOTE_ADDR", "") if request is not None else ""
        try:
            accounts.check_login_allowed(userid, address)
        except TooManyLoginAttempts as exc:
            raise exceptions.Throttled(wait=exc.retry_after, detail=str(exc)) from None
        try:
            authenticated = super().authenticate_credentials(userid, password, request)
        except exceptions.AuthenticationFailed:
            accounts.record_login_failure(userid, address)
            raise
        accounts.clear_login_failures(userid, address)
        return authenticated


class ThrottledBasicScheme(BasicScheme):
    """The OpenAPI schema names it as plain HTTP basic auth."""

    target_class = "marketplace.api.auth.ThrottledBasicAuthentication"
