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
signals in ``marketplace.celery``). This module imports no Django: the settings module builds its
LOGGING here.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

if TYPE_CHECKING:
    from django.http import HttpRequest

    class IdentifiedRequest(HttpRequest):
        """A request as ``RequestIdMiddleware`` passes it on, for views' annotations (defined for the
        type checker only: this module imports no Django when it runs)."""

        request_id: str


REQUEST_ID: ContextVar[str | None] = ContextVar("swarm_request_id", default=None)
JOB_ID: ContextVar[str | None] = ContextVar("swarm_job_id", default=None)
_VARS = {"request_id": REQUEST_ID, "job_id": JOB_ID}
UNSET = "-"  # what a line outside any request or job shows for the id it lacks
# The Celery message headers that carry the context to a worker.
TASK_HEADERS = {"request_id": "swarm_request_id", "job_id": "swarm_job_id"}
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s request=%(request_id)s job=%(job_id)s %(message)s"
JSON_FIELDS = ["levelname", "name", "request_id", "job_id", "message"]  # and "timestamp"

Bound = list[tuple[ContextVar[str | None], Token[str | None]]]


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def bind(**ids: str | None) -> Bound:
    """Name ``request_id`` and/or ``job_id`` (None or "": no such id) in the lines logged from here
    on in this context; the ids not given keep their value. Returns what ``unbind`` undoes."""
    return [(_VARS[name], _VARS[name].set(value or None)) for name, value in ids.items()]


def unbind(tokens: Bound) -> None:
    for var, token in reversed(tokens):
        var.reset(token)


@contextlib.contextmanager
def bound(**ids: str | None) -> Iterator[None]:
    """``bind`` for the block, undone on its way out."""
    tokens = bind(**ids)
    try:
        yield
    finally:
        unbind(tokens)


class ContextFilter(logging.Filter):
    """Copies the request id and the job id onto each record (``-`` when there is none). An id
    given with the call (``extra={"job_id": ...}``, for a line about a job logged outside it) wins."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in _VARS.items():
            if not getattr(record, name, None):
                setattr(record, name, var.get() or UNSET)
        return True


class TextFormatter(logging.Formatter):
    """Times in UTC, ISO 8601 to the millisecond: ``2025-01-31T12:00:00.123Z``."""

    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"

    def converter(self, secs: float | None) -> time.struct_time:
        return time.gmtime(secs)


def logging_config(log_format: str, level: str) -> dict[str, Any]:
    """``settings.LOGGING``: one handler on the root logger, to stderr, in ``log_format`` ("text":
    ``TEXT_FORMAT``; "json": one object per line with ``timestamp``, ``level``, ``logger``,
    ``request_id``, ``job_id``, ``message``, and ``exc_info`` or any ``extra`` fields of the call).
    uvicorn's loggers lose their own handlers and propagate here, so its lines look the same."""
    if log_format == "json":
        formatter = {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": JSON_FIELDS,
            "rename_fields": {"levelname": "level", "name": "logger"},
            "timestamp": True,  # UTC, ISO 8601
        }
    else:
        formatter = {"()": TextFormatter, "format": TEXT_FORMAT}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": ContextFilter}},
        "formatters": {"swarm": formatter},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "swarm", "filters": ["context"]}},
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            **{name: {"handlers": [], "propagate": True} for name in ("uvicorn", "uvicorn.access")},
            # A task's start and end are logged by ``marketplace.celery`` with its ids; Celery's own
            # "received" and "succeeded" lines for each (the periodic work runs every few seconds)
            # only repeat them.
            **{name: {"level": "WARNING"} for name in ("celery.worker.strategy", "celery.app.trace")},
        },
    }


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
    return {header: value for name, header in TASK_HEADERS.items() if (value := _VARS[name].get())}


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
