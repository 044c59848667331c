"""Celery tasks of the verification app (queue "verify" for the checks; beat for the schedules)."""

from __future__ import annotations

from celery import shared_task

from marketplace.verification import services


@shared_task(name="marketplace.verification.tasks.verify_challenge")
def verify_challenge_task(challenge_pk: int) -> str:
    return services.verify_challenge(challenge_pk).state


@shared_task(name="marketplace.verification.tasks.verify_audit")
def verify_audit_task(audit_pk: int) -> str:
    return services.verify_audit(audit_pk).state


@shared_task(name="marketplace.verification.tasks.send_challenges")
def send_challenges() -> list[int]:
    return services.send_due_challenges()


@shared_task(name="marketplace.verification.tasks.review")
def review() -> dict:
    return services.review()
