"""Counts every HTTP request the Django app answers, by endpoint, method and status, and times it.

The endpoint is the URL route that matched (``/api/v1/nodes/<pk>`` style, from the URL patterns),
never the raw path: ids in paths would make a series per object. A path no pattern matches counts
as ``unmatched``. A streamed answer (Server-Sent Events) is timed to the end of its stream.
Sits first in MIDDLEWARE, so it sees the status that actually went out.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import cast

from asgiref.sync import iscoroutinefunction
from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
from django.urls import Resolver404, resolve
from django.utils.decorators import sync_and_async_middleware

from marketplace import metrics

UNMATCHED = "unmatched"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def endpoint_of(request: HttpRequest) -> str:
    """The URL route ``request`` matched, as ``/v1/chat/completions`` or ``/api/v1/nodes/(?P<pk>[^/.]+)/``."""
    match = getattr(request, "resolver_match", None)
    if match is None:  # answered before URL resolution (a redirect to HTTPS, a refused host)
        try:
            match = resolve(request.path_info)
        except Resolver404:
            return UNMATCHED
    return "/" + match.route.removesuffix("$")  # a regex route's end anchor says nothing here


def method_of(request: HttpRequest) -> str:
    method = request.method or ""
    return method if method in METHODS else "other"


def _observe(request: HttpRequest, response: HttpResponseBase, started: float) -> HttpResponseBase:
    endpoint, method, status = endpoint_of(request), method_of(request), response.status_code
    if isinstance(response, StreamingHttpResponse) and response.is_async:
        # is_async says the content is the async iterator (the stubs type it as either kind).
        content = cast(AsyncIterator[bytes], response.streaming_content)
        response.streaming_content = _timed(
            content, lambda: metrics.http_request(endpoint, method, status, elapsed(started))
        )
    else:
        metrics.http_request(endpoint, method, status, elapsed(started))
    return response


async def _timed(content: AsyncIterator[bytes], done: Callable[[], None]) -> AsyncIterator[bytes]:
    """Pass a streamed body through, and record the request once it ended (or its client left)."""
    try:
        async for chunk in content:
            yield chunk
    finally:
        try:
            await content.aclose()  # type: ignore[attr-defined]
        finally:
            done()


def elapsed(started: float) -> float:
    return time.perf_counter() - started


@sync_and_async_middleware
def http_metrics(get_response):
    if iscoroutinefunction(get_response):

        async def middleware(request: HttpRequest) -> HttpResponseBase:
            started = time.perf_counter()
            return _observe(request, await get_response(request), started)

    else:

        def middleware(request: HttpRequest) -> HttpResponseBase:  # type: ignore[misc]
            started = time.perf_counter()
            return _observe(request, get_response(request), started)

    return middleware
