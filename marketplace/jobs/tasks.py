"""Launching a job's coordinator: a Celery task on ``coord.<region>`` (threads pool), or in this process."""

from __future__ import annotations

import asyncio
import contextvars

from celery import shared_task
from django.conf import settings

from marketplace import logs
from marketplace.jobs.models import Job
from marketplace.jobs.runner import run_job

_embedded_jobs: set[asyncio.Task] = set()


@shared_task(name="marketplace.jobs.tasks.run_job", acks_late=False)
def run_job_task(job_pk: int) -> str:
    # acks_late off: a coordinator that died mid-stream must not be replayed onto a new stream.
    return asyncio.run(run_job(job_pk))


def launch(job: Job) -> None:
    """Start the job's coordinator: a Celery task on ``coord.<region>``, or in this process."""
    if settings.SWARM_COORDINATOR_LAUNCH == "celery":
        with logs.bound(job_id=job.public_id):  # its message carries the job's id to the worker's lines
            run_job_task.apply_async(args=[job.pk], queue=f"coord.{job.coordinator_region}")
        return
    # A fresh context: the job must not inherit the request's (and so its per-request database
    # thread and connection), since it outlives the request.
    task = asyncio.get_running_loop().create_task(run_job(job.pk), context=contextvars.Context())
    _embedded_jobs.add(task)
    task.add_done_callback(_embedded_jobs.discard)
