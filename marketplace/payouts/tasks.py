"""Celery beat tasks of the payouts app."""

from __future__ import annotations

from celery import shared_task

from marketplace.payouts import services


@shared_task(name="marketplace.payouts.tasks.release_earnings")
def release_earnings() -> int:
    return services.release_earnings()


@shared_task(name="marketplace.payouts.tasks.build_batch")
def build_batch() -> int | None:
    batch = services.build_batch()
    return batch.pk if batch else None


@shared_task(name="marketplace.payouts.tasks.send_payouts")
def send_payouts() -> dict:
    return services.send_payouts()
