"""Bearer API keys at the HTTP edge: one decorator authenticates ``Authorization: Bearer <key>``
and hands the view the key, so no view repeats the preamble.

    @api_key_required
    async def credits(request, api_key): ...

A request without an active key is answered 401 in OpenAI's error shape before the view runs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse

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
