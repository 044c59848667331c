"""Celery tasks of the verification app: the checks, on the queue "verify" (periodic work: ``marketplace.periodic``)."""

from __future__ import annotations

from celery import shared_task

from marketplace.verification import audits, challenges
from marketplace.verification.dispatch import AUDIT_TASK, CHALLENGE_RUN_TASK, CHALLENGE_TASK


@shared_task(name=CHALLENGE_TASK)
def verify_challenge_task(challenge_pk: int) -> str:
    return challenges.verify_challenge(challenge_pk).state


@shared_task(name=AUDIT_TASK)
def verify_audit_task(audit_pk: int) -> str:
    return audits.verify_audit(audit_pk).state


@shared_task(name=CHALLENGE_RUN_TASK)
def run_challenge_task(challenge_pk: int) -> str:
    return challenges.run_challenge(challenge_pk).state
