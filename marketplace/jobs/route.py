"""A job's route: the stages it was admitted onto, stored on the job as JSON maps in pipeline order
(``{node, node_key, url, layer_start, layer_end}``), and the ``StageAssignment`` list that receipt
verification checks against. The runner hands that list to the job's coordinator and settlement
verifies the stored receipts against it, so both read the route through this one function."""

from __future__ import annotations

from worker_agent.errors import ReceiptError
from worker_agent.receipts import StageAssignment


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
