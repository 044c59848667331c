"""The one table of periodic work: every entry resolves, Celery beat gets one entry per row at its
setting's period, and the embedded scheduler runs the rows in table order at their periods."""

from __future__ import annotations

import asyncio

import pytest
from django.conf import settings
from django.utils.module_loading import import_string

from marketplace import periodic

pytestmark = pytest.mark.control


def test_every_entry_names_a_function_and_a_period_setting():
    for work in periodic.PERIODIC_WORK:
        assert callable(import_string(work.function)), work.name
        assert float(getattr(settings, work.every)) > 0, work.name
    assert len(periodic.BY_NAME) == len(periodic.PERIODIC_WORK)


def test_celery_beat_runs_each_row_at_its_settings_period():
    periods = {"SWARM_SWEEP_INTERVAL_S": 2.0, "SWARM_TRUST_INTERVAL_S": 10.0}

    schedule = periodic.beat_schedule(periods)

    assert list(schedule) == [work.name for work in periodic.PERIODIC_WORK]
    assert schedule["heartbeats"] == {"task": "marketplace.periodic.run", "args": ("heartbeats",), "schedule": 2.0}
    assert schedule["earnings"] == {"task": "marketplace.periodic.run", "args": ("earnings",), "schedule": 10.0}
    assert periodic.beat_schedule({name: getattr(settings, name) for name in periods}) == settings.CELERY_BEAT_SCHEDULE


# The scheduler runs each row through ``database_sync_to_async``, whose worker thread first closes
# the old connection it may hold from an earlier test of this process: database access is allowed.
@pytest.mark.django_db
def test_the_embedded_scheduler_runs_rows_in_order_at_their_periods(monkeypatch, settings):
    settings.SWARM_SWEEP_INTERVAL_S = 0.01
    settings.SWARM_TRUST_INTERVAL_S = 0.05
    ran: list[str] = []

    def record(name: str) -> None:
        ran.append(name)
        if name == "review":
            raise RuntimeError("one row failing does not stop the others")

    monkeypatch.setattr(periodic, "run_work", record)

    async def main() -> None:
        task = asyncio.create_task(periodic.embedded_scheduler(0.01))
        try:
            async with asyncio.timeout(60):
                while ran.count("payouts") < 2:
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()

    asyncio.run(main())

    sweep = [w.name for w in periodic.PERIODIC_WORK if w.every == "SWARM_SWEEP_INTERVAL_S"]
    trust = [w.name for w in periodic.PERIODIC_WORK if w.every == "SWARM_TRUST_INTERVAL_S"]
    assert ran[: len(sweep)] == sweep  # the first tick: the sweep rows, in table order
    assert ran.count("heartbeats") > ran.count("payouts") >= 2  # the sweep runs more often than trust work
    first_trust = ran.index(trust[0])
    assert ran[first_trust : first_trust + len(trust)] == trust
