"""The control plane's periodic work, in one table read by both Celery beat and the embedded scheduler.

Each entry names an idempotent function that takes no argument and the setting that holds its
period in seconds. In production Celery beat runs every entry as the task ``marketplace.periodic.run``
(``settings.CELERY_BEAT_SCHEDULE`` is built from this table); in the embedded default the web
process runs them in table order (``embedded_scheduler``, started on ASGI lifespan startup).

Functions are named by dotted path, as Celery names tasks: this module is read by ``settings.py``
before any app is loaded, so it imports none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery import shared_task

log = logging.getLogger("swarm.scheduler")

RUN_TASK = "marketplace.periodic.run"


@dataclass(frozen=True)
class PeriodicWork:
    name: str  # the entry's name (Celery beat's key)
    function: str  # dotted path of an idempotent function taking no argument
    every: str  # name of the setting that holds its period, in seconds


PERIODIC_WORK: tuple[PeriodicWork, ...] = (
    # Take silent nodes offline (their blocks are released), share the nodes among the models by
    # demand, look for unbalanced load, re-place what needs it, move spares where they help most,
    # and end jobs whose coordinator was lost.
    PeriodicWork("heartbeats", "marketplace.placement.lifecycle.sweep_heartbeats", "SWARM_SWEEP_INTERVAL_S"),
    PeriodicWork("shares", "marketplace.jobs.demand.share_nodes_by_demand", "SWARM_SWEEP_INTERVAL_S"),
    PeriodicWork("rebalance", "marketplace.placement.rebalancing.rebalance_if_needed", "SWARM_SWEEP_INTERVAL_S"),
    PeriodicWork("placement", "marketplace.placement.placing.place_dirty_models", "SWARM_SWEEP_INTERVAL_S"),
    # Move a spare that churn left on a span held often enough onto one held once, without a spare.
    PeriodicWork("spares", "marketplace.jobs.spares.respread_spares", "SWARM_SWEEP_INTERVAL_S"),
    PeriodicWork("jobs", "marketplace.flows.settlement.reconcile_jobs", "SWARM_SWEEP_INTERVAL_S"),
    # Forget Idempotency-Keys (and the answers kept for their retries) past their time.
    PeriodicWork("idempotency", "marketplace.jobs.idempotency.forget_expired", "SWARM_TRUST_INTERVAL_S"),
    # Trust: send due challenges, expire unanswered ones and uphold unreviewed strikes, release
    # earnings whose window passed, build the payout batch when due, send approved payouts.
    PeriodicWork("challenges", "marketplace.verification.challenges.send_due_challenges", "SWARM_TRUST_INTERVAL_S"),
    PeriodicWork("review", "marketplace.verification.review.review", "SWARM_TRUST_INTERVAL_S"),
    PeriodicWork(
        "earnings", "marketplace.verification.strikes.release_earnings_in_good_standing", "SWARM_TRUST_INTERVAL_S"
    ),
    PeriodicWork("payout-batches", "marketplace.payouts.services.build_batch_if_due", "SWARM_TRUST_INTERVAL_S"),
    PeriodicWork("payouts", "marketplace.payouts.services.send_payouts", "SWARM_TRUST_INTERVAL_S"),
)
BY_NAME = {work.name: work for work in PERIODIC_WORK}


def beat_schedule(periods: Mapping[str, Any]) -> dict:
    """Celery beat's schedule for the table, with each period read from ``periods`` (the settings)."""
    return {
        work.name: {"task": RUN_TASK, "args": (work.name,), "schedule": float(periods[work.every])}
        for work in PERIODIC_WORK
    }


def run_work(name: str) -> None:
    """Run one entry of the table now; its outcome is logged at debug level, not returned (it may not be JSON)."""
    from django.utils.module_loading import import_string  # settings imports this module: Django is not set up yet

    work = BY_NAME[name]
    outcome = import_string(work.function)()
    log.debug("%s: %s", name, outcome)


@shared_task(name=RUN_TASK)
def run(name: str) -> None:
    run_work(name)


async def embedded_scheduler(tick_s: float, stop: asyncio.Event | None = None) -> None:
    """Run the table in this process: every tick, each entry whose period has passed, in table order.
    One entry's failure is logged and does not stop the others. Returns once ``stop`` is set and the
    entry running then has ended: an entry cut off mid-run (its task cancelled) would go on in its
    worker thread, and one that calls back into this event loop (a channel-layer send) would then
    wait forever on a loop that stopped, holding the thread every database call of the process uses."""
    from channels.db import database_sync_to_async  # settings imports this module: Django is not set up yet
    from django.conf import settings

    stop = stop or asyncio.Event()
    last_run = dict.fromkeys(BY_NAME, time.monotonic())  # each entry first runs one period after start
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), tick_s)
        now = time.monotonic()
        for work in PERIODIC_WORK:
            if stop.is_set():
                return
            if now - last_run[work.name] < float(getattr(settings, work.every)) - 1e-3:
                continue
            last_run[work.name] = now
            try:
                await database_sync_to_async(run_work)(work.name)
            except Exception:
                log.exception("periodic work %s failed", work.name)
