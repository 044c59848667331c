"""Where a stored check is verified: in this process after the transaction commits ("inline", the
embedded default, or Celery running eagerly), or as a Celery task on the queue "verify"."""

from __future__ import annotations

from collections.abc import Callable

from celery import current_app
from django.conf import settings
from django.db import transaction

CHALLENGE_TASK = "marketplace.verification.tasks.verify_challenge"  # Celery task names, queue "verify"
AUDIT_TASK = "marketplace.verification.tasks.verify_audit"
CHALLENGE_RUN_TASK = "marketplace.verification.tasks.run_challenge"  # a challenge's session over the data plane


def thresholds() -> dict:
    return {"min_cosine": settings.SWARM_CHECK_MIN_COSINE, "max_rel_norm": settings.SWARM_CHECK_MAX_REL_NORM}


def verify_after_commit(task_name: str, inline: Callable[[int], object], pk: int) -> None:
    """Run a check once the current transaction commits: ``inline(pk)`` here, or the task by name
    (sent by name because tasks.py imports the check modules)."""
    if settings.SWARM_VERIFIER == "inline" or current_app.conf.task_always_eager:
        transaction.on_commit(lambda: inline(pk))
        return
    transaction.on_commit(lambda: current_app.send_task(task_name, args=[pk], queue="verify"))
