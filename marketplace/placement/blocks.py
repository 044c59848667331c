"""A placed block's smallest steps: whose it is, and letting it go at its agent.

A released block is recorded at once (routing takes only ready blocks); its agent is told to let it
go at once too, unless a new block on the same node supersedes it: then only once that block is
ready or failed to load (make before break, ``readiness.assignment_ready``).
"""

from __future__ import annotations

from django.utils import timezone

from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node
from marketplace.nodes.services import push
from marketplace.placement.models import Assignment, AssignmentState
from worker_agent.protocol import control_protocol as protocol


def joined_id(node: Node) -> str:
    """The id of a node that placement handles (a candidate, a block's holder, an active or draining
    node): each has joined, so each has one."""
    assert node.node_id is not None
    return node.node_id


def release(assignment: Assignment) -> None:
    """Release a live block: recorded, the agent told, the node's pages updated."""
    assignment.state, assignment.released_at = AssignmentState.RELEASED, timezone.now()
    assignment.save(update_fields=["state", "released_at"])
    push_release(assignment)
    notify_node_changed(assignment.node_id)


def push_release(assignment: Assignment) -> None:
    """Tell the agent to let ``assignment``'s block go, and every older block it still holds for it."""
    current: Assignment | None = assignment
    while current is not None:
        push(
            joined_id(current.node),
            protocol.to_wire(protocol.Release(assignment=current.pk, model=current.model)),
        )
        older = current.supersedes
        if older is not None:
            Assignment.objects.filter(pk=current.pk).update(supersedes=None)
        current = older


def release_superseded(assignment_pk: int) -> None:
    """The new block is ready or failed: the agent may let the blocks it superseded go."""
    assignment = Assignment.objects.select_related("supersedes__node").get(pk=assignment_pk)
    if assignment.supersedes is not None:
        older = assignment.supersedes
        Assignment.objects.filter(pk=assignment.pk).update(supersedes=None)
        push_release(older)
