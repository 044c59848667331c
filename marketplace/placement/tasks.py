"""Periodic work of the control plane (Celery beat in production, in-process when embedded)."""

from __future__ import annotations

from celery import shared_task

from marketplace.nodes.services import sweep_heartbeats
from marketplace.placement.services import place_dirty_models, rebalance_if_needed


def run_periodic() -> dict:
    """Take silent nodes offline, look for unbalanced load, re-place what needs it, and settle
    jobs whose coordinator was lost."""
    from marketplace.jobs.services import reconcile_jobs

    offline = sweep_heartbeats()
    rebalanced = rebalance_if_needed()
    placed = place_dirty_models()
    reconciled = reconcile_jobs()
    return {"offline": offline, "rebalanced": rebalanced, "placed": placed, "reconciled": reconciled}


def run_trust_periodic() -> dict:
    """The embedded stand-in for the trust schedules of Celery beat: send due challenges, expire
    unanswered ones, uphold unreviewed strikes, refresh reputations, release earnings whose window
    passed, build the day's payout batch, send approved payouts."""
    from marketplace.payouts import services as payouts
    from marketplace.verification import services as verification

    challenged = verification.send_due_challenges()
    reviewed = verification.review()
    released = payouts.release_earnings()
    batch = payouts.build_batch_if_due()
    sent = payouts.send_payouts()
    return {
        "challenged": challenged,
        "reviewed": reviewed,
        "released": released,
        "batch": batch.pk if batch else None,
        "payouts": sent,
    }


@shared_task(name="marketplace.placement.tasks.sweep")
def sweep() -> dict:
    return run_periodic()
