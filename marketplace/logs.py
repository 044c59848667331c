"""The log context: every line the control plane logs names the request and the job it was written for.

Two context variables hold the request id (``req_<hex>``, named at the HTTP edge by
``RequestIdMiddleware`` and sent back to the client in the ``x-request-id`` header) and the job id
(the job's public id, e.g. ``chatcmpl-<hex>``, bound where a job runs: ``flows.runner.run_job``, and
a Celery task through its message headers). ``ContextFilter``, on the handler that
``logging_config`` builds for ``settings.LOGGING``, copies them onto each record as ``request_id``
and ``job_id``, ``-`` outside any request or job.

Context variables follow the code that serves a request wherever it goes: into ``sync_to_async``
threads (asgiref copies the context there and back), into the tasks it creates (asyncio copies it),
and across the broker to a Celery worker (``task_headers`` and ``bind_task``, hooked to Celery's
signals in ``marketplace.celery``). The variables, the filter and the two formats are
``worker_agent.logs``', which the agents log through too: one format for every process of the
swarm. This module imports no Django: the settings module builds its LOGGING here.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

from worker_agent import logs as shared
from worker_agent.logs import (  # noqa: F401  (the control plane's names for the shared ones)
    JOB_ID,
    LOG_FORMATS,
    LOG_LEVELS,
    REQUEST_ID,
    UNSET,
    Bound,
    ContextFilter,
    TextFormatter,
    bind,
    bound,
    unbind,
)

if TYPE_CHECKING:
    from django.http import HttpRequest

    class IdentifiedRequest(HttpRequest):
        """A request as ``RequestIdMiddleware`` passes it on, for views' annotations (defined for the
        type checker only: this module imports no Django when it runs)."""

        request_id: str


# Celery message headers that carry the context to a worker.
TASK_HEADERS = {"request_id": "swarm_request_id", "job_id": "swarm_job_id"}
# A task's start and end are logged by ``marketplace.celery`` with its ids; Celery's own "received"
# and "succeeded" lines for each (the periodic work runs every few seconds) only repeat them.
QUIET = ("celery.worker.strategy", "celery.app.trace")
# uvicorn's loggers lose their own handlers and propagate to ours, so its lines look the same.
ADOPTED = ("uvicorn", "uvicorn.access")


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def logging_config(log_format: str, level: str) -> dict[str, Any]:
    """``settings.LOGGING``: the swarm's one format (``worker_agent.logs``), with uvicorn's lines
    adopted and Celery's routine ones quieted."""
    return shared.logging_config(log_format, level, quiet=QUIET, adopt=ADOPTED)


class RequestIdMiddleware:
    """Names each HTTP request ``req_<hex>``: ``request.request_id``, the ``x-request-id`` header
    of its answer (whatever the answer: a refusal, a redirect, a stream), and every line logged
    while it is served. Early in MIDDLEWARE, so that the other middleware's lines have it too."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self._serve(request)
        request.request_id = new_request_id()
        with bound(request_id=request.request_id, job_id=None):
            return self._stamp(request, self.get_response(request))

    async def _serve(self, request):
        request.request_id = new_request_id()
        # Not undone: an ASGI server serves each request in an asyncio task of its own, whose
        # context ends with it. Left bound, the id also names the lines logged after the view
        # returned, while the answer is sent: a stream's, Django's own "Bad Request" lines, the
        # server's access line.
        bind(request_id=request.request_id, job_id=None)
        return self._stamp(request, await self.get_response(request))

    @staticmethod
    def _stamp(request, response):
        if "x-request-id" not in response:
            response["x-request-id"] = request.request_id
        return response


def task_headers() -> dict[str, str]:
    """The log context as Celery message headers, for a task queued now (``before_task_publish``)."""
    return {header: value for name, header in TASK_HEADERS.items() if (value := shared.current(name))}


def bind_task(request: Any) -> Bound:
    """Bind the log context a task's message carries (``task_prerun``): its ``request`` holds the
    message's headers, under ``headers`` in an eagerly applied task. Returns what ``unbind`` undoes
    at ``task_postrun``; nothing when the message carries none (a task run in the caller's own
    context already has the caller's)."""
    headers: Mapping[str, Any] = getattr(request, "headers", None) or {}
    carried = {name: headers.get(header) or getattr(request, header, None) for name, header in TASK_HEADERS.items()}
    if not any(carried.values()):
        return []
    return bind(**carried)
