"""A job's route: the stages it was admitted onto, stored on the job as JSON maps in pipeline order
(``{node, node_key, url, layer_start, layer_end}``), and the ``StageAssignment`` list that receipt
verification checks against. Admission writes it with ``route_of``; the runner hands the assignments
to the job's coordinator and settlement verifies the stored receipts against them, so both read the
route through ``route_assignments``."""

from __future__ import annotations

from collections.abc import Iterable

from marketplace.placement.selectors import PipelineStage
from worker_agent.errors import ReceiptError
from worker_agent.protocol.receipts import StageAssignment


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
