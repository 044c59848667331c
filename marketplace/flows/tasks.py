"""Launching a job's coordinator: a Celery task on ``coord.<region>`` (threads pool), or in this process.

In a coordinator worker every job runs on one event loop of the process (``job_loop``), in a
thread of its own; the Celery task only hands the job to it and waits. So the worker's job
concurrency is its Celery concurrency (each waiting thread costs a thread, not an event loop),
jobs share the process's connections to Redis and the database pool, and a burst of jobs is not
held at the pool's size while the stages still have room for sessions.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

from celery import shared_task
from django.conf import settings

from marketplace import logs
from marketplace.flows.runner import run_job
from marketplace.jobs import services
from marketplace.jobs.models import Job

_embedded_jobs: set[asyncio.Task] = set()
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def job_loop() -> asyncio.AbstractEventLoop:
    """This process's coordinator event loop, started on first use in a daemon thread. Its default
    executor (where jobs run their ORM and cache calls, ``runner.in_thread``) has
    SWARM_COORDINATOR_DB_THREADS threads; each holds a database connection only for a call."""
    global _loop
    with _loop_lock:
        if _loop is None or not _loop.is_running():
            loop = asyncio.new_event_loop()
            loop.set_default_executor(
                ThreadPoolExecutor(settings.SWARM_COORDINATOR_DB_THREADS, thread_name_prefix="job-db")
            )
            started = threading.Event()
            loop.call_soon(started.set)
            threading.Thread(target=loop.run_forever, name="coordinators", daemon=True).start()
            started.wait()
            _loop = loop
        return _loop


# The name it had in marketplace.jobs.tasks, kept: a job queued by a web process of the release before
# the move still finds its task in a coordinator worker of this one, and the other way round.
@shared_task(name="marketplace.jobs.tasks.run_job", acks_late=False)
def run_job_task(job_pk: int, brief: dict | None = None) -> str:
    # acks_late off: a coordinator that died mid-stream must not be replayed onto a new stream.
    return asyncio.run_coroutine_threadsafe(run_job(job_pk, brief), job_loop()).result()


def launch(job: Job) -> None:
    """Start the job's coordinator: a Celery task on ``coord.<region>``, or in this process."""
    brief = services.job_brief(job)  # a keyword argument: the task's logged arguments leave it out
    if settings.SWARM_COORDINATOR_LAUNCH == "celery":
        with logs.bound(job_id=job.public_id):  # its message carries the job's id to the worker's lines
            run_job_task.apply_async(args=[job.pk], kwargs={"brief": brief}, queue=f"coord.{job.coordinator_region}")
        return
    # A fresh context: the job must not inherit the request's (and so its per-request database
    # thread and connection), since it outlives the request.
    task = asyncio.get_running_loop().create_task(run_job(job.pk, brief), context=contextvars.Context())
    _embedded_jobs.add(task)
    task.add_done_callback(_embedded_jobs.discard)
