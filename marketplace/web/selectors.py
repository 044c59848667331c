"""Read queries of the dashboards that the other apps' selectors do not already answer."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Avg, Count, Sum
from django.utils import timezone

from marketplace.billing import selectors as billing
from marketplace.billing.display import count_text, usd_detail
from marketplace.billing.models import TopUp
from marketplace.billing.services import prices_for
from marketplace.catalog.selectors import served_models
from marketplace.jobs import selectors as job_selectors
from marketplace.jobs.models import FINAL_STATES, ApiKey, Job, JobState
from marketplace.jobs.services import PLAYGROUND_KEY_NAME
from marketplace.nodes.models import LinkMeasurement, Node, NodeState
from marketplace.placement.models import LIVE_STATES, Assignment, AssignmentState, PlacementState
from marketplace.placement.selectors import servable_pipelines
from marketplace.web import charts
from marketplace.web.node_selectors import AgentStatus, ReputationTrack, agent_status, reputation_track
from marketplace.web.trust_selectors import admin_todo
from worker_agent import model as models
from worker_agent.checkpoints import ref_name

THROUGHPUT_WINDOW_S = 60
THROUGHPUT_MINUTES = 30


# --- providers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    model: str
    layer_start: int
    layer_end: int
    state: str  # the assignment's: assigned (loading) or ready
    spare: bool
    pipeline: int
    position: int


@dataclass(frozen=True)
class NodeStatus:
    node: Node
    blocks: tuple[Block, ...]
    tokens_served: int | None  # by the block it serves now, as its agent last reported
    sessions: int | None
    agent: AgentStatus  # what its agent does now, as the control plane knows it
    track: ReputationTrack | None  # its reputation as a rising track; None until first computed
    connected_for_s: float | None  # how long its current control channel has been up
    heartbeat_age_s: float | None


def node_status(node: Node, now: datetime | None = None) -> NodeStatus:
    now = now or timezone.now()
    blocks = tuple(
        Block(a.model, a.layer_start, a.layer_end, a.state, a.is_spare, a.pipeline, a.position)
        for a in Assignment.objects.filter(node=node, state__in=LIVE_STATES).order_by("model")
    )
    load = node.load or {}
    connected_for = (
        (now - node.connected_since).total_seconds() if node.connected and node.connected_since is not None else None
    )
    heartbeat_age = (now - node.last_heartbeat_at).total_seconds() if node.last_heartbeat_at else None
    tokens = load.get("tokens_served")
    sessions = load.get("sessions")
    return NodeStatus(
        node=node,
        blocks=blocks,
        tokens_served=int(tokens) if tokens is not None else None,
        sessions=int(sessions) if sessions is not None else None,
        agent=agent_status(node, blocks, str(load.get("state", ""))),
        track=reputation_track(node),
        connected_for_s=max(0.0, connected_for) if connected_for is not None else None,
        heartbeat_age_s=max(0.0, heartbeat_age) if heartbeat_age is not None else None,
    )


def provider_nodes(user) -> list[NodeStatus]:
    now = timezone.now()
    return [node_status(node, now) for node in Node.objects.filter(owner=user, deleted_at__isnull=True).order_by("id")]


def node_of(user, pk: int) -> Node | None:
    """The provider's own node; None for another provider's (which must look absent)."""
    return Node.objects.filter(owner=user, pk=pk, deleted_at__isnull=True).first()


def node_counts(user) -> dict[str, int]:
    counts = dict(Node.objects.filter(owner=user, deleted_at__isnull=True).values_list("state").annotate(n=Count("id")))
    return {state: counts.get(state, 0) for state in NodeState.values}


# --- customers ------------------------------------------------------------------------------------


def api_keys(user) -> list[ApiKey]:
    return list(ApiKey.objects.filter(user=user).order_by("revoked_at", "-created_at"))


def key_of(user, pk: int) -> ApiKey | None:
    return ApiKey.objects.filter(user=user, pk=pk).first()


def playground_key(user) -> ApiKey | None:
    return ApiKey.objects.filter(user=user, name=PLAYGROUND_KEY_NAME, revoked_at__isnull=True).order_by("pk").first()


def top_ups(user, limit: int = 10) -> list[TopUp]:
    return list(TopUp.objects.filter(customer=user).order_by("-id")[:limit])


def top_up_of(user, pk: int) -> TopUp | None:
    """The customer's own top-up; None for another's (which must look absent)."""
    return TopUp.objects.filter(customer=user, pk=pk).first()


def job_of(user, public_id: str) -> Job | None:
    return Job.objects.filter(customer=user, public_id=public_id).first()


@dataclass(frozen=True)
class ServableModel:
    id: str
    prompt_per_million: int  # nano-dollars per million prompt tokens
    completion_per_million: int  # nano-dollars per million completion tokens


def servable_models() -> list[ServableModel]:
    found = []
    for model in served_models():
        if servable_pipelines(model):
            prompt, completion = prices_for(model)
            found.append(ServableModel(ref_name(model), prompt, completion))
    return found


def example_model() -> str:
    """A model to name in a first request: one servable now, else the first the server offers."""
    servable = servable_models()
    if servable:
        return servable[0].id
    offered = served_models()
    return ref_name(offered[0]) if offered else "smollm2-135m"


@dataclass(frozen=True)
class UsageView:
    group: str
    rows: list[dict]
    tokens_chart: charts.BarChart
    cost_chart: charts.BarChart
    total_requests: int
    total_tokens: int
    total_cost: str


GROUP_TITLES = {"day": "day", "model": "model", "key": "API key"}


def usage_view(user, group: str) -> UsageView:
    rows = job_selectors.usage(user, group)
    for row in rows:
        row["label"] = row[group] if row[group] is not None else "(deleted key)"
        if group == "key" and row[group] is not None:
            row["label"] = f"{row['key_name']} ({row['key']}…)"
        row["tokens"] = row["prompt_tokens"] + row["completion_tokens"]
    tokens_chart = charts.bar_chart(
        f"Tokens by {GROUP_TITLES[group]}", [(r["label"], r["tokens"], count_text(r["tokens"])) for r in rows]
    )
    cost_chart = charts.bar_chart(
        f"Cost by {GROUP_TITLES[group]} (USD)",
        [(r["label"], float(r["cost"]), usd_detail(r["cost"])) for r in rows],
        tick=charts.dollar_tick,
    )
    total_nano = Job.objects.filter(customer=user).aggregate(s=Sum("charged_amount"))["s"]
    return UsageView(
        group=group,
        rows=rows,
        tokens_chart=tokens_chart,
        cost_chart=cost_chart,
        total_requests=sum(r["requests"] for r in rows),
        total_tokens=sum(r["tokens"] for r in rows),
        total_cost=billing.money(total_nano),
    )


# --- admins ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    node_name: str
    node_id: str
    layer_start: int
    layer_end: int
    region: str
    trusted: bool = False  # an admin marked its node trusted


@dataclass(frozen=True)
class Pipeline:
    region: str  # where its coordinator runs
    stages: list[Stage]

    @property
    def trusted(self) -> bool:
        """Every stage on a trusted node: a ``trusted_only`` request may take it."""
        return all(stage.trusted for stage in self.stages)


@dataclass
class ModelHealth:
    model: str
    n_layers: int
    generation: int
    note: str
    coordinator_regions: list[str]
    ready_nodes: int  # nodes whose block of this model is loaded, on an active node
    loading_nodes: int  # nodes still loading their block
    layers_covered: int  # layers held by a ready stage of a serving pipeline
    pipelines: list[Pipeline]  # servable, end to end
    coverage: charts.CoverageMap


def model_health(model: str) -> ModelHealth:
    n_layers = models.n_layers(model)
    state = PlacementState.objects.filter(model=model).first()
    live = list(
        Assignment.objects.filter(model=model, state__in=LIVE_STATES)
        .select_related("node")
        .order_by("is_spare", "pipeline", "position")
    )
    ready = [a for a in live if a.state == AssignmentState.READY and a.node.state == NodeState.ACTIVE]
    covered = [False] * n_layers
    for a in ready:
        if not a.is_spare:
            for layer in range(a.layer_start, min(a.layer_end, n_layers)):
                covered[layer] = True
    spans = [
        {
            "label": a.node.name,
            "detail": (
                f"{a.node.name} ({a.node.node_id}): layers {a.layer_start}–{a.layer_end}, {a.state}"
                f"{', spare' if a.is_spare else f', pipeline {a.pipeline + 1} stage {a.position + 1}'}"
                f", node {a.node.state}"
            ),
            "state": a.state,
            "spare": a.is_spare,
            "node_state": a.node.state,
            "layer_start": a.layer_start,
            "layer_end": a.layer_end,
        }
        for a in live
    ]
    names, trusted = {}, set()
    for node_id, name, trusted_at in Node.objects.filter(node_id__isnull=False).values_list(
        "node_id", "name", "trusted_at"
    ):
        names[node_id] = name
        if trusted_at is not None:
            trusted.add(node_id)
    regions = list(state.coordinator_regions) if state else []
    pipeline_of = {a.node.node_id: a.pipeline for a in live if not a.is_spare}
    pipelines = []
    for servable in servable_pipelines(model):
        index = pipeline_of.get(servable[0].node, -1)
        pipelines.append(
            Pipeline(
                region=regions[index] if 0 <= index < len(regions) else "",
                stages=[
                    Stage(names.get(s.node, s.node), s.node, s.layer_start, s.layer_end, s.region, s.node in trusted)
                    for s in servable
                ],
            )
        )
    return ModelHealth(
        model=model,
        n_layers=n_layers,
        generation=state.generation if state else 0,
        note=state.note if state else "",
        coordinator_regions=regions,
        ready_nodes=len({a.node_id for a in ready}),
        loading_nodes=len({a.node_id for a in live if a.state == AssignmentState.ASSIGNED}),
        layers_covered=sum(covered),
        pipelines=pipelines,
        coverage=charts.coverage_map(n_layers, spans, covered),
    )


def swarm_health() -> list[ModelHealth]:
    return [model_health(model) for model in served_models()]


@dataclass(frozen=True)
class NodeRow:
    node: Node
    owner: str
    heartbeat_age_s: float | None


def all_nodes() -> tuple[dict[str, int], list[NodeRow]]:
    """Nodes per state, and every node with its owner's name."""
    now = timezone.now()
    counts = dict(Node.objects.values_list("state").annotate(n=Count("id")))
    rows = [
        NodeRow(
            node,
            node.owner.username,
            max(0.0, (now - node.last_heartbeat_at).total_seconds()) if node.last_heartbeat_at else None,
        )
        for node in Node.objects.select_related("owner").order_by("state", "name", "id")
    ]
    return {state: counts.get(state, 0) for state in NodeState.values}, rows


def node_by_pk(pk: int) -> Node | None:
    return Node.objects.select_related("owner").filter(pk=pk).first()


@dataclass(frozen=True)
class HeatCell:
    rtt_ms: float | None
    colour: str
    title: str


@dataclass(frozen=True)
class HeatRow:
    node_id: str
    name: str
    cells: list[HeatCell]


@dataclass(frozen=True)
class Heatmap:
    targets: list[tuple[str, str]]  # (target id, label): nodes, then coordinator regions
    rows: list[HeatRow]  # one per measuring node
    highest_ms: float


def latency_heatmap() -> Heatmap:
    """Measured round trips from each node (rows) to peers and coordinator regions (columns)."""
    links = list(LinkMeasurement.objects.select_related("source"))
    names = dict(Node.objects.filter(node_id__isnull=False).values_list("node_id", "name"))
    sources = sorted(
        # Every source is a joined node: only an agent's reports are recorded.
        {(source_id, link.source.name) for link in links if (source_id := link.source.node_id) is not None},
        key=lambda s: (s[1], s[0]),
    )
    node_targets = sorted({link.target for link in links if not link.target.startswith("region:")})
    node_targets.sort(key=lambda t: (names.get(t, t), t))
    region_targets = sorted({link.target for link in links if link.target.startswith("region:")})
    targets = [(t, names.get(t, t)) for t in node_targets]
    targets += [(t, t.removeprefix("region:") + " (region)") for t in region_targets]
    rtt = {(link.source.node_id, link.target): link.rtt_ms for link in links}
    highest = max(rtt.values(), default=0.0)
    rows = []
    for source, source_name in sources:
        cells = []
        for target, label in targets:
            value = rtt.get((source, target))
            if value is None:
                title = f"{source_name} to {label}: " + ("itself" if target == source else "not measured")
                cells.append(HeatCell(None, "#f2f4f7", title))
            else:
                title = f"{source_name} to {label}: {value:.1f} ms"
                cells.append(HeatCell(value, charts.heat_colour(value, highest), title))
        rows.append(HeatRow(source, source_name, cells))
    return Heatmap(targets, rows, highest)


@dataclass(frozen=True)
class Throughput:
    window_s: int
    tokens: int  # completion tokens of jobs that ended in the window
    jobs: int
    tokens_per_s: float
    running: int
    mean_decode_tokens_per_s: float | None  # of the jobs that ended in the window
    chart: charts.BarChart
    minutes: list[tuple[str, int]]


def throughput(now: datetime | None = None) -> Throughput:
    now = now or timezone.now()
    ended = Job.objects.filter(state__in=FINAL_STATES, finished_at__isnull=False)
    recent = ended.filter(finished_at__gt=now - timedelta(seconds=THROUGHPUT_WINDOW_S)).aggregate(
        tokens=Sum("completion_tokens"), jobs=Count("id"), decode=Avg("tokens_per_s")
    )
    start = (now - timedelta(minutes=THROUGHPUT_MINUTES - 1)).replace(second=0, microsecond=0)
    per_minute = [0] * THROUGHPUT_MINUTES
    for finished_at, tokens in ended.filter(finished_at__gte=start).values_list("finished_at", "completion_tokens"):
        assert finished_at is not None  # ended jobs are filtered on finished_at
        index = int((finished_at - start).total_seconds() // 60)
        if 0 <= index < THROUGHPUT_MINUTES:
            per_minute[index] += tokens
    minutes = [((start + timedelta(minutes=i)).strftime("%H:%M"), tokens) for i, tokens in enumerate(per_minute)]
    chart = charts.bar_chart(
        "Tokens per second, per minute (UTC)",
        [(label, tokens / 60, f"{tokens / 60:.2f} tokens/s") for label, tokens in minutes],
        width=640,
        height=240,
    )
    tokens = recent["tokens"] or 0
    return Throughput(
        window_s=THROUGHPUT_WINDOW_S,
        tokens=tokens,
        jobs=recent["jobs"],
        tokens_per_s=tokens / THROUGHPUT_WINDOW_S,
        running=Job.objects.filter(state=JobState.RUNNING).count(),
        mean_decode_tokens_per_s=recent["decode"],
        chart=chart,
        minutes=minutes,
    )


# --- everyone -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    id: str
    text: str
    url_name: str  # the page where it is done
    done: bool


def getting_started(user) -> list[Step] | None:
    """A new customer's first steps, each ticked once done; None once all are."""
    jobs = Job.objects.filter(customer=user)
    own_keys = ApiKey.objects.filter(user=user).exclude(name=PLAYGROUND_KEY_NAME)
    steps = [
        Step("credits", "Add credits", "web:billing", billing.totals(user)["total_credits"] > 0),
        Step("playground", "Try a model in the playground", "web:playground",
             jobs.filter(api_key__name=PLAYGROUND_KEY_NAME).exists()),
        Step("key", "Create an API key", "web:keys", own_keys.exists()),
        Step("request", "Send a first request with it", "web:keys", jobs.filter(api_key__in=own_keys).exists()),
    ]  # fmt: skip
    return None if all(step.done for step in steps) else steps


def home_overview(user) -> dict:
    overview: dict = {}
    if user.is_provider:
        overview["node_counts"] = node_counts(user)
        overview["node_total"] = sum(overview["node_counts"].values())
    if user.is_customer:
        overview["balance"] = billing.balance(user)
        overview["active_keys"] = ApiKey.objects.filter(user=user, revoked_at__isnull=True).count()
        overview["getting_started"] = getting_started(user)
    if user.is_staff:
        overview["servable_models"] = [m.id for m in servable_models()]
        overview["active_nodes"] = Node.objects.filter(state=NodeState.ACTIVE).count()
        overview["todo"] = admin_todo()
    return overview
