"""Which node hosts which layers of which model, per placement generation."""

from __future__ import annotations

from django.db import models

from marketplace.catalog.selectors import assignment_source
from marketplace.nodes.models import Node
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol.span import Span


class AssignmentState(models.TextChoices):
    ASSIGNED = "assigned", "assigned"  # pushed to the agent, block loading
    READY = "ready", "ready"  # the agent loaded the block and serves it
    FAILED = "failed", "failed"  # the agent could not load it
    RELEASED = "released", "released"  # superseded by a newer placement, or the node left


LIVE_STATES = (AssignmentState.ASSIGNED, AssignmentState.READY)


class Assignment(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="assignments")
    model = models.CharField(max_length=128)
    generation = models.PositiveIntegerField()  # the placement that created or last confirmed it
    pipeline = models.PositiveIntegerField()  # index of the pipeline within the placement
    position = models.PositiveIntegerField()  # stage index within the pipeline
    layer_start = models.PositiveIntegerField()
    layer_end = models.PositiveIntegerField()  # exclusive
    is_spare = models.BooleanField(default=False)  # holds a warm block, not on the serving path
    state = models.CharField(max_length=16, choices=AssignmentState.choices, default=AssignmentState.ASSIGNED)
    data_url = models.CharField(max_length=255, blank=True)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    # The node's previous block of this model, released in the database (nothing new is routed to
    # it) but still held by the agent for its jobs in flight: the agent is told to let it go once
    # this one is ready, or has failed. Cleared once that message is sent.
    supersedes = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="superseded_by"
    )

    class Meta:
        ordering = ["model", "pipeline", "position"]
        constraints = [
            models.CheckConstraint(condition=models.Q(layer_start__lt=models.F("layer_end")), name="span_not_empty"),
            # A node holds at most one live block of a model.
            models.UniqueConstraint(
                fields=["node", "model"],
                condition=models.Q(state__in=["assigned", "ready"]),
                name="one_live_assignment_per_node_and_model",
            ),
        ]

    @property
    def span(self) -> Span:
        return Span(self.model, self.layer_start, self.layer_end)

    def as_message(self) -> protocol.Assign:
        """The assignment for its agent; a catalog model's names where to fetch its files."""
        source = assignment_source(self.model)
        return protocol.Assign(
            assignment=self.pk,
            model=self.model,
            layer_start=self.layer_start,
            layer_end=self.layer_end,
            content_hash=source.get("content_hash"),
            source=source.get("source"),
        )


class PlacementState(models.Model):
    """One row per served model: its current placement generation and whether it must be redone."""

    model = models.CharField(max_length=128, unique=True)
    generation = models.PositiveIntegerField(default=0)
    dirty = models.BooleanField(default=True)
    placed_at = models.DateTimeField(null=True, blank=True)
    note = models.TextField(blank=True)  # why the last placement could not cover the model, if so
    coordinator_regions = models.JSONField(default=list)  # per pipeline: the region its coordinator runs in
    # When several models are served (``shares``): the node ids this model may be placed on, the
    # demand (tokens over the window) the share was last made for, and when demand last moved a node.
    share = models.JSONField(default=list)
    demand = models.FloatField(default=0.0)
    shared_at = models.DateTimeField(null=True, blank=True)
