"""One log format for every process of the swarm: agents, relays, coordinators and the control plane.

Each line names the request and the job it was written for. Two context variables hold the request
id (``req_<hex>``, named at the control plane's HTTP edge) and the job id (the job's public id, e.g.
``chatcmpl-<hex>``; on an agent, bound by the connection that serves the job). ``ContextFilter``,
on the one handler ``logging_config`` builds, copies them onto each record as ``request_id`` and
``job_id``, ``-`` outside any request or job. Times are UTC, ISO 8601 to the millisecond.

Two formats: "text" (``TEXT_FORMAT``) and "json" (one object per line with ``timestamp``,
``level``, ``logger``, ``request_id``, ``job_id``, ``message``, and ``exc_info`` or any ``extra``
fields of the call), for a log collector. This module imports neither Django nor torch: an agent's
``--help`` and the control plane's settings load it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import logging.config
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar, Token
from typing import Any

REQUEST_ID: ContextVar[str | None] = ContextVar("swarm_request_id", default=None)
JOB_ID: ContextVar[str | None] = ContextVar("swarm_job_id", default=None)
_VARS = {"request_id": REQUEST_ID, "job_id": JOB_ID}
UNSET = "-"  # what a line outside any request or job shows for the id it lacks
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s request=%(request_id)s job=%(job_id)s %(message)s"
JSON_FIELDS = ["levelname", "name", "request_id", "job_id", "message"]  # and "timestamp"

Bound = list[tuple[ContextVar[str | None], Token[str | None]]]


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


def current(name: str) -> str | None:
    """The bound ``request_id`` or ``job_id``, None when there is none."""
    return _VARS[name].get()


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


def logging_config(
    log_format: str, level: str, *, quiet: Iterable[str] = (), adopt: Iterable[str] = ()
) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` dict: one handler on the root logger, to stderr, in
    ``log_format``, at ``level``. The loggers in ``quiet`` log WARNING and above only (a library's
    routine lines that repeat ours); those in ``adopt`` lose their own handlers and propagate here,
    so their lines look the same."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
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
            **{name: {"handlers": [], "propagate": True} for name in adopt},
            **{name: {"level": "WARNING"} for name in quiet},
        },
    }


# The websockets library logs each connection's opening and closing at INFO ("connection open",
# "server listening"): routine chatter on a data plane that opens a connection per job.
AGENT_QUIET = ("websockets.server", "websockets.client")


def configure(log_format: str = "text", level: str = "info") -> None:
    """Set up logging for a command-line process of the swarm (an agent, a relay, a coordinator);
    the websockets library's routine lines show at ``debug`` only."""
    level = level.upper()
    logging.config.dictConfig(logging_config(log_format, level, quiet=AGENT_QUIET if level != "DEBUG" else ()))


def add_log_options(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format``, as every command that serves takes them."""
    levels = [level.lower() for level in LOG_LEVELS]
    parser.add_argument("--log-level", default="info", type=str.lower, choices=levels, help="default: info")
    parser.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text (default): UTC time, level, logger, request and job ids, message; json: one object per line",
    )
