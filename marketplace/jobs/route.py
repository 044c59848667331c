"""A job's route: the stages it was admitted onto, stored on the job as JSON maps in pipeline order
(``{node, node_key, url, layer_start, layer_end}``), and the ``StageAssignment`` list that receipt
verification checks against. Admission writes it with ``route_of``; the runner hands the assignments
to the job's coordinator and settlement verifies the stored receipts against them, so both read the
route through ``route_assignments``."""

from __future__ import annotations

from collections.abc import Iterable

from marketplace.jobs.models import Job, JobState
from marketplace.placement.selectors import PipelineStage
from worker_agent.errors import ReceiptError
from worker_agent.protocol.receipts import StageAssignment
from worker_agent.protocol.span import Span


def route_of(stages: Iterable[PipelineStage]) -> list[dict]:
    """The route stored on a job, from the stages placement chose for it, in pipeline order."""
    return [
        {
            "node": s.node,
            "node_key": s.node_key,
            "url": s.data_url,
            "layer_start": s.layer_start,
            "layer_end": s.layer_end,
        }
        for s in stages
    ]


def route_assignments(route: object) -> list[StageAssignment]:
    """The route's stages as assignments, in pipeline order; ReceiptError naming the first bad stage."""
    if not isinstance(route, list):
        raise ReceiptError(f"a job's route must be a list of stages, got {type(route).__name__}")
    assignments = []
    for index, stage in enumerate(route):
        try:
            assignments.append(StageAssignment.from_json(stage))
        except ReceiptError as exc:
            raise ReceiptError(f"route stage {index}: {exc}") from None
    return assignments


def open_jobs_on(node: str, span: Span, *, limit: int) -> tuple[str, ...]:
    """The public ids of the jobs admitted onto ``node``'s block of ``span`` (in their route now, a
    heal included) and not ended, the newest ``limit`` of them: the jobs a released block still owes
    its service (``control_protocol.Release.jobs``)."""
    open_jobs = Job.objects.filter(model=span.model, state__in=[JobState.QUEUED, JobState.RUNNING]).order_by("-pk")
    found = []
    for public_id, route in open_jobs.values_list("public_id", "route").iterator():
        on_block = any(
            isinstance(stage, dict)
            and (stage.get("node"), stage.get("layer_start"), stage.get("layer_end")) == (node, span.start, span.end)
            for stage in (route if isinstance(route, list) else ())
        )
        if on_block:
            found.append(public_id)
            if len(found) == limit:
                break
    return tuple(found)
