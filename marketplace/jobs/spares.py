"""Spares where they help most: the periodic step that moves a warm spare off a span held often
enough onto a span held once and by no spare (``placement.placing.respread_spares``).

It lives with the jobs because only a spare that carries no open job moves, and placement sits
below jobs and never imports them: the sweep runs ``respread_spares`` here, which hands placement
the check.
"""

from __future__ import annotations

from marketplace.jobs.route import open_jobs_on
from marketplace.placement import placing
from worker_agent.protocol.span import Span


def carries_open_job(node: str, span: Span) -> bool:
    """Whether a job not ended was routed onto ``node``'s block of ``span`` (a heal included)."""
    return bool(open_jobs_on(node, span, limit=1))


def respread_spares() -> list[str]:
    """The periodic entry: at most one spare moved per placed model; the models where one moved."""
    return placing.respread_spares(carries_open_job)
