"""The Celery app: coordinator queues per region, periodic sweeps (Celery beat).

Logging: a worker logs as the web process does (``settings.LOGGING``, built by
``marketplace.logs``), never in Celery's own format; a task queued inside a request or a job
carries their ids in its message headers, and its worker logs its start and end, and every line
between, with them.
"""

from __future__ import annotations

import logging
import logging.config
import os
from typing import Any

from celery import Celery
from celery.signals import before_task_publish, setup_logging, task_postrun, task_prerun, worker_ready
from django.conf import settings

from marketplace import logs
from marketplace.periodic import RUN_TASK

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")

app = Celery("marketplace")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

log = logging.getLogger("swarm.tasks")
_bound: dict[str, logs.Bound] = {}  # by task id: the log context bound from its message, until it ends


@setup_logging.connect
def use_django_logging(**_: Any) -> None:
    """With a receiver here Celery configures no logging of its own (nor redirects stdout), and
    ``settings.LOGGING`` applies: the same format, level (SWARM_LOG_LEVEL, not ``--loglevel``)
    and context ids as the web process."""
    logging.config.dictConfig(settings.LOGGING)


@worker_ready.connect
def warm_models(sender: Any = None, **_: Any) -> None:
    """Load the served models' configs and tokenizers, and in a coordinator worker (one consuming a
    ``coord.*`` queue) their heads, before the first task: a coordinator worker runs every job on
    one event loop (``flows.tasks``), which a cold load would hold for seconds under the first burst."""
    # Imported once Django is set up (this module is imported before it) and torch only in the
    # workers that start, not in every importer.
    from marketplace.catalog.selectors import served_models
    from marketplace.db import release_connections
    from worker_agent import heap
    from worker_agent import model as models

    models.set_threads(settings.SWARM_TORCH_THREADS)
    queues = [queue.name for queue in getattr(getattr(sender, "task_consumer", None), "queues", [])]
    coordinator = any(name.startswith("coord.") for name in queues)
    try:
        served = served_models()
    finally:
        release_connections()  # not held by this thread for the worker's life
    for model in served:
        try:
            models.load_config(model)
            models.load_tokenizer(model)
            if coordinator:
                models.load_head(model)
        except Exception as exc:  # a broken checkpoint must not keep the worker from the other models
            log.warning("model %s: not preloaded: %s", model, exc)
    if settings.SWARM_FREEZE_HEAP:
        heap.settle()  # what the worker keeps for good is loaded: no full collection walks it again


@before_task_publish.connect
def carry_log_context(headers: dict | None = None, **_: Any) -> None:
    if headers is not None:
        headers.update(logs.task_headers())


def _level(task: Any, state: str | None = None) -> int:
    """The periodic work (a task every few seconds) logs at DEBUG unless it failed; others at INFO."""
    if task.name == RUN_TASK and state in (None, "SUCCESS"):
        return logging.DEBUG
    return logging.INFO if state in (None, "SUCCESS") else logging.WARNING


@task_prerun.connect
def task_started(task_id: str, task: Any, args: tuple = (), **_: Any) -> None:
    _bound[task_id] = logs.bind_task(task.request)
    log.log(_level(task), "task %s[%s] started with %s", task.name, task_id, list(args))


@task_postrun.connect
def task_ended(task_id: str, task: Any, state: str | None = None, **_: Any) -> None:
    log.log(_level(task, state), "task %s[%s] ended: %s", task.name, task_id, state)
    logs.unbind(_bound.pop(task_id, []))
