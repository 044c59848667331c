"""Celery entry point of a job's coordinator (queue ``coord.<region>``, threads pool)."""

from __future__ import annotations

import asyncio

from celery import shared_task

from marketplace.jobs.runner import run_job


@shared_task(name="marketplace.jobs.tasks.run_job", acks_late=False)
def run_job_task(job_pk: int) -> str:
    # acks_late off: a coordinator that died mid-stream must not be replayed onto a new stream.
    return asyncio.run(run_job(job_pk))
