"""Read queries about placements."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from django.conf import settings
from django.db.models import Max, Q
from django.utils import timezone

from marketplace.catalog.selectors import served_models
from marketplace.nodes.capacity import assess
from marketplace.nodes.models import LinkMeasurement, Node, NodeState, Privacy
from marketplace.placement.allocation import Stage
from marketplace.placement.errors import PlacementError
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from marketplace.placement.round_trips import credible_round_trips
from marketplace.placement.routing import route
from worker_agent import model as models
from worker_agent.kvcache import SessionLimits

# Positions per session, and sessions at once, of an agent that reports no limit: the agent's defaults.
AGENT_DEFAULT_POSITIONS = SessionLimits().max_tokens
AGENT_DEFAULT_SESSIONS = SessionLimits().max_sessions


def session_room(node: Node) -> int:
    """Jobs a node's stage may carry at once: what it reported holding (its agent refuses a session
    past that), capped by SWARM_JOBS_PER_NODE. A node claiming more than it holds only fails its
    own sessions, and the jobs heal around it."""
    return min(node.max_sessions or AGENT_DEFAULT_SESSIONS, settings.SWARM_JOBS_PER_NODE)


@dataclass(frozen=True)
class PipelineStage:
    node: str
    node_key: str
    data_url: str
    layer_start: int
    layer_end: int
    region: str
    # The node's audit fraction when the stage was read (None: a new node's default applies), so
    # that admission draws the job's audits without reading the nodes again.
    audit_fraction: float | None = field(default=None, compare=False)

    @property
    def stage(self) -> Stage:
        """The node and span, as placement's routing takes and returns them."""
        return Stage(self.node, self.layer_start, self.layer_end)


def live_assignments(model: str):
    return (
        Assignment.objects.filter(model=model, state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])
        .select_related("node")
        .order_by("pipeline", "position")
    )


def assignments_of_node(node_pk: int):
    return Assignment.objects.filter(node_id=node_pk, state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])


# ``serving`` as a filter on assignments, for queries that need no rows of their own.
SERVING = Q(
    state=AssignmentState.READY,
    node__state=NodeState.ACTIVE,
    node__connected=True,
    node__suspected_at__isnull=True,
    node__under_review=False,
)


def serving(assignment: Assignment) -> bool:
    """A stage that may serve: its block is ready on an active node that no job's coordinator has
    reported failed since its last sign of life and that no open strike holds under review (a
    failed check takes it off routing at once). Its failures may still keep it off routing for now
    (``backed_off``): then it serves only where no chain avoids it."""
    node = assignment.node
    return (
        assignment.state == AssignmentState.READY
        and node.state == NodeState.ACTIVE
        and node.connected  # an agent that said it is stopping is off routing before it refuses a job
        and node.suspected_at is None
        and not node.under_review
    )


def backed_off(node: Node) -> bool:
    """Whether ``node``'s failures keep requests off it now (``verification.failures``: the back-off
    doubles with each one). Routing takes such a node's stage last, only where no chain of the
    others covers the model (``route_request``, ``route_around``): a node that failed a job and
    answers its heartbeats still serves where it is the only way through (a stage the machine's
    load starved past the stall timeout, with no spare, must not leave its model without a route),
    and one that keeps failing while it answers them is struck and under review, off routing."""
    return node.routing_backoff_until is not None and node.routing_backoff_until > timezone.now()


def allowed_for(assignment: Assignment, privacy: str, n_layers: int) -> bool:
    """Whether a request of ``privacy`` may pass through ``assignment``'s stage: any stage for
    ``any``; only a trusted node's for ``trusted_only``; for ``trusted_ends``, an untrusted node's
    only when its block holds neither the first layer (it would see the prompt's embeddings) nor
    the last (the states the output comes from)."""
    if privacy == Privacy.ANY or assignment.node.trusted:
        return True
    if privacy == Privacy.TRUSTED_ENDS:
        return assignment.layer_start > 0 and assignment.layer_end < n_layers
    return False


def _pipeline_stage(a: Assignment) -> PipelineStage:
    node = a.node
    assert node.node_id is not None and node.public_key is not None  # a node with a block has joined
    return PipelineStage(
        node.node_id, node.public_key, a.data_url or node.data_url, a.layer_start, a.layer_end, node.region,
        node.audit_fraction,
    )  # fmt: skip


def servable_pipelines(model: str) -> list[list[PipelineStage]]:
    """Pipelines of the current placement whose every stage is serving (ready, on an active node not
    reported failed: ``serving``, a stage backed off for its failures included, which routing takes
    as a last resort), in order."""
    state = PlacementState.objects.filter(model=model).first()
    if state is None:
        return []
    pipelines: dict[int, list[Assignment]] = {}
    for assignment in live_assignments(model).filter(is_spare=False):
        pipelines.setdefault(assignment.pipeline, []).append(assignment)
    servable = []
    for stages in pipelines.values():
        if not all(serving(a) for a in stages):
            continue
        position = 0
        for a in stages:
            if a.layer_start != position:
                break
            position = a.layer_end
        else:
            if position == models.n_layers(model):
                servable.append([_pipeline_stage(a) for a in stages])
    return servable


def model_positions(model: str) -> int | None:
    """The model's own position limit (its config's ``max_position_embeddings``), if it has one."""
    limit = getattr(models.load_config(model), "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def context_length(model: str) -> int | None:
    """Tokens one request to ``model`` may total (prompt + completion): the model's own position
    limit, and no more than any routable stage's node holds per session, since a request's route,
    or the route a heal moves it to, may pass through any of them. A node that reported no limit
    counts with the agent's default. None when no stage is routable."""
    reported = Assignment.objects.filter(SERVING, model=model).values_list("node__max_positions", flat=True)
    limits = [limit or AGENT_DEFAULT_POSITIONS for limit in reported]
    if not limits:
        return None
    own = model_positions(model)
    return min(limits if own is None else [own, *limits])


def shared_models() -> list[str]:
    """The models that share the nodes, in ``served_models`` order; empty when one model is served."""
    served = served_models()
    return served if len(served) > 1 else []


def share_of(model: str) -> set[str] | None:
    """The node ids ``model`` may be placed on now; None when nodes are not shared (one model
    served, or a model outside SWARM_MODELS): then every node may take it."""
    if model not in shared_models():
        return None
    state = PlacementState.objects.filter(model=model).only("share").first()
    return set(state.share) if state is not None else set()


def leaving(model: str, assignments: Collection[Assignment]) -> set[str]:
    """The nodes of ``assignments`` (live blocks of ``model``) that are leaving it: moved to another
    model's share, their block held only until ``model`` is servable without it (make before break,
    ``rebalancing.release_leaving``). Decided when the share moved, so routing avoids them from then."""
    share = share_of(model)
    if share is None:
        return set()
    # Every node with a block has joined: none lacks an id.
    return {node_id for a in assignments if (node_id := a.node.node_id) is not None and node_id not in share}


def is_servable(model: str) -> bool:
    return bool(servable_pipelines(model))


def recovering(model: str, privacy: str = Privacy.ANY) -> bool:
    """Whether capacity for ``model`` may come back soon: it is placed and some node online holds
    or is loading a block of it (a trusted node's, for a request that asks for trusted nodes). A
    request that finds no route may then wait a little for one (admission, a heal) instead of
    failing at once; a model no such node serves fails at once."""
    if not PlacementState.objects.filter(model=model).exists():
        return False
    live = live_assignments(model).filter(node__state=NodeState.ACTIVE)
    if privacy != Privacy.ANY:
        live = live.filter(node__trusted_at__isnull=False)
    return live.exists()


def region_target(region: str) -> str:
    return f"region:{region}"


def link_maps(node_ids: list[str]) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """Measured round trips (directed, by node id or ``region:<name>``) and uplinks.

    A node measures its links to peers (each direction by its sender) and to coordinator
    regions; a region cannot measure back, so a node<->region link counts the node's measurement
    for both directions. A region's uplink is configured (SWARM_REGION_UPLINK_MBPS).
    """
    rtt = link_rtts(node_ids)
    uplink: dict[str, float] = {}
    measured = LinkMeasurement.objects.filter(source__node_id__in=node_ids, uplink_mbps__isnull=False)
    for source, value in (
        measured.values("source__node_id").annotate(best=Max("uplink_mbps")).values_list("source__node_id", "best")
    ):
        assert source is not None  # filtered by node id
        uplink[source] = value
    for source, value in Node.objects.filter(node_id__in=node_ids, uplink_mbps__isnull=False).values_list(
        "node_id", "uplink_mbps"
    ):
        assert source is not None and value is not None  # filtered by both
        uplink.setdefault(source, value)
    for region in settings.SWARM_COORDINATOR_REGIONS:
        uplink[region_target(region)] = settings.SWARM_REGION_UPLINK_MBPS
    return rtt, uplink


def link_rtts(node_ids: list[str]) -> dict[tuple[str, str], float]:
    """``link_maps``' round trips alone (one query): what routing needs."""
    rtt: dict[tuple[str, str], float] = {}
    rows = LinkMeasurement.objects.filter(source__node_id__in=node_ids).values_list(
        "source__node_id", "target", "rtt_ms"
    )
    for source, target, value in rows:
        assert source is not None  # filtered by node id
        rtt[(source, target)] = value
        if target.startswith("region:"):
            rtt[(target, source)] = value
    # A report the other end of its link contradicts counts as that end measured it (``round_trips``).
    return credible_round_trips(
        rtt, tolerance=settings.SWARM_RTT_CLAIM_TOLERANCE, margin_ms=settings.SWARM_RTT_CLAIM_MARGIN_MS
    )


def stage_costs(
    nodes: list[str], rows: list[Node] | None = None
) -> tuple[dict[tuple[str, str], float], dict[str, float], frozenset[str]]:
    """Measured round trips between ``nodes`` (and the regions), each node's time per layer (ms)
    at its credible speed, and the nodes whose speed claim is in doubt (``nodes.capacity``).
    ``rows``: those nodes' rows when the caller has them already (one query fewer)."""
    rtt = link_rtts(nodes)
    credence = assess(Node.objects.filter(node_id__in=nodes) if rows is None else rows)
    return rtt, {node: 1000.0 / value for node, value in credence.speeds.items() if value}, credence.in_doubt


def last_resort_first(stages: list[Stage], last_resort: Collection[str]) -> list[list[Stage]]:
    """The sets of ``stages`` routing tries in turn: first without the ``last_resort`` nodes (leaving
    the model, unmeasured with a claim in doubt, or ``backed_off`` for their failures), then all of
    them: such a node gets a request only when no chain avoids it."""
    preferred = [s for s in stages if s.node not in last_resort]
    return [preferred, stages] if len(preferred) < len(stages) else [stages]


def hold_routes(model: str) -> bool:
    """Lock the model's placement row until the caller's transaction ends; True when the model is
    placed. Every choice of a route for a job (admission, a heal) and every decision that releases or
    moves a live block of the model (a placement, letting a leaving node go, a block superseding
    another) takes it first, so they happen one after the other: a route chosen after a release
    reads it (a block being released is never picked), and a job routed before one commits before
    it (the block keeps serving it). Taken before any assignment row, as ``placing.place_model``
    does, so that the locks are always taken in one order."""
    return PlacementState.objects.select_for_update().filter(model=model).only("pk").first() is not None


def route_request(
    model: str,
    busy: Mapping[str, int] | None = None,
    *,
    placed: bool = False,
    privacy: str = Privacy.ANY,
    prefer: Sequence[tuple[str, int, int]] | None = None,
):
    """The lowest-latency chain of routable stages for one request, and the coordinator region it
    starts from; None when no chain covers the model. Stages are every routable block of the
    model, on pipelines and warm spares alike: while a pipeline has a member reported failed (or
    being replaced), a spare holding its span keeps the model servable, as it does for a request
    healing around it (``route_around``). With ``busy`` (jobs in flight by node id), a node
    carrying its ``session_room`` already is left out. ``placed``: the caller knows the model has
    a placement (admission locked its row), so it is not looked up again. ``privacy``: only stages
    that ``allowed_for`` lets such a request through. A stage of a node leaving the model, unmeasured
    with a speed claim in doubt, or backed off for its failures is taken only when no chain avoids
    it (``last_resort_first``).

    ``prefer``: a route, as (node, layer_start, layer_end) stages, whose nodes hold the request's
    longest prefix (``jobs.prefixes``): taken instead of the lowest-latency chain while all its stages
    are usable and its cost is within SWARM_PREFIX_ROUTE_MARGIN of that chain's (KV locality: its
    stages compute only the rest of the prompt)."""
    if not placed and not PlacementState.objects.filter(model=model).exists():
        return None
    busy = busy or {}
    n_layers = models.n_layers(model)
    usable = [
        a
        for a in live_assignments(model)
        if serving(a) and busy.get(a.node.node_id, 0) < session_room(a.node) and allowed_for(a, privacy, n_layers)
    ]
    if not usable:
        return None
    stages = [_pipeline_stage(a) for a in usable]
    rows = list({a.node.node_id: a.node for a in usable}.values())
    rtt, layer_ms, in_doubt = stage_costs(sorted(node.node_id for node in rows), rows)
    last_resort = in_doubt | leaving(model, usable) | {node.node_id for node in rows if backed_off(node)}
    tiers = last_resort_first([s.stage for s in stages], last_resort)
    preferred = [Stage(*stage) for stage in prefer or ()]
    best = held = None
    for candidates in tiers:
        keeps = bool(preferred) and set(preferred) <= set(candidates)
        for region in settings.SWARM_COORDINATOR_REGIONS:
            try:
                candidate = route(candidates, n_layers, rtt, layer_ms, source=region_target(region))
            except PlacementError:
                break  # no chain of these stages covers every layer
            if best is None or candidate.cost_ms < best[1].cost_ms:
                best = (region, candidate)
            if keeps:
                with contextlib.suppress(PlacementError):  # the remembered stages no longer chain up
                    mine = route(preferred, n_layers, rtt, layer_ms, source=region_target(region))
                    if held is None or mine.cost_ms < held[1].cost_ms:
                        held = (region, mine)
        if best is not None:
            break
    if best is None:
        return None  # no chain of routable stages covers every layer
    if held is not None and held[1].cost_ms <= best[1].cost_ms * (1 + settings.SWARM_PREFIX_ROUTE_MARGIN):
        best = held
    region, chosen = best
    by_stage = {s.stage: s for s in stages}
    return region, [by_stage[s] for s in chosen.stages], chosen.cost_ms


def route_around(
    model: str,
    current: list[Stage],
    avoid: Collection[str],
    region: str,
    privacy: str = Privacy.ANY,
) -> list[PipelineStage] | None:
    """A replacement route for a request in flight on ``current`` (its stages in order) that passes
    through none of the ``avoid`` nodes, from the coordinator ``region`` where it runs, and only
    through stages its ``privacy`` allows (``allowed_for``); None when no such route exists.

    Stages are every routable block of the model, on pipelines and warm spares alike (a stage's
    pipeline need not be whole: the request only needs a chain). The route keeps the request's
    surviving stages when it can: first the layers that only the failed stages held are filled from
    the stages lying inside those gaps (a spare or another pipeline's stage holding exactly a dead
    span fills it in one), so that only the dead spans change; failing that, the fastest full chain.
    Either way a stage of a node leaving the model, with a speed claim in doubt or backed off for its
    failures only when no chain of those candidates avoids it (``last_resort_first``).
    """
    avoid = set(avoid)
    n_layers = models.n_layers(model)
    usable = [
        a
        for a in live_assignments(model)
        if serving(a) and a.node.node_id not in avoid and allowed_for(a, privacy, n_layers)
    ]
    stages = {ps.stage: ps for ps in map(_pipeline_stage, usable)}
    if not stages:
        return None
    rtt, layer_ms, in_doubt = stage_costs(sorted({stage.node for stage in stages}))
    last_resort = in_doubt | leaving(model, usable) | {a.node.node_id for a in usable if backed_off(a.node)}
    survivors = [stage for stage in current if stage in stages]
    in_gaps = [
        stage
        for stage in stages
        if not any(stage.layer_start < kept.layer_end and kept.layer_start < stage.layer_end for kept in survivors)
    ]  # each overlaps no survivor
    for tried in (survivors + in_gaps, list(stages)):
        for candidates in last_resort_first(tried, last_resort):
            try:
                chosen = route(candidates, n_layers, rtt, layer_ms, source=region_target(region))
            except PlacementError:
                continue
            return [stages[s] for s in chosen.stages]
    return None
