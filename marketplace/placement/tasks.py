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


@shared_task(name="marketplace.placement.tasks.sweep")
def sweep() -> dict:
    return run_periodic()
