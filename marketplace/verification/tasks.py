"""Celery tasks of the verification app: the checks, on the queue "verify" (periodic work: ``marketplace.periodic``)."""

from __future__ import annotations

from celery import shared_task

from marketplace.verification import services


@shared_task(name=services.CHALLENGE_TASK)
def verify_challenge_task(challenge_pk: int) -> str:
    return services.verify_challenge(challenge_pk).state


@shared_task(name=services.AUDIT_TASK)
def verify_audit_task(audit_pk: int) -> str:
    return services.verify_audit(audit_pk).state
