"""Read queries of the trust and payout pages: a node's reputation, checks and strikes (with the
evidence as the pages show it), a provider's earnings, the admins' strike queue and payout batches."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Sum
from django.utils import timezone

from marketplace.billing.display import nano_detail
from marketplace.billing.selectors import dollars
from marketplace.nodes.models import Node, NodeState
from marketplace.payouts import selectors as payouts
from marketplace.payouts.models import (
    BatchState,
    ConnectAccount,
    Earning,
    EarningState,
    Payout,
    PayoutBatch,
    PayoutState,
)
from marketplace.verification.models import Audit, Challenge, CheckState, Strike, StrikeState
from marketplace.web import charts

RECENT_CHECKS = 10  # challenges and audits listed on a node's page
RECENT_ROWS = 50  # earnings, payouts and decided strikes listed
EARNINGS_DAYS = 30


# --- a node: reputation, checks, strikes ----------------------------------------------------------


@dataclass(frozen=True)
class Component:
    label: str
    value: float | int
    share: bool  # a share in [0, 1] (shown as a percentage), else a count


COMPONENTS = (
    ("uptime", "Uptime", True),
    ("check_pass_rate", "Check pass rate", True),
    ("reliability", "Challenges answered in time", True),
    ("age", "Age (share of the 30 days that count fully)", True),
    ("upheld_strikes", "Upheld strikes", False),
)


def _number(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _moment(value) -> datetime | None:
    try:
        return datetime.fromisoformat(value) if value else None
    except (TypeError, ValueError):
        return None


def _ms_between(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() * 1000 if start is not None and end is not None else None


@dataclass(frozen=True)
class Evidence:
    """What a strike's evidence says, in the fields both pages show."""

    kind: str  # "challenge" or "audit"
    seed: str  # the challenge's seed ("" for an audit)
    tokens: int | None
    job: str  # the audited job's public id ("" for a challenge)
    session: str
    stage: int | None  # the audited stage's position in the job's pipeline
    model: str
    layers: tuple[int, int] | None  # [start, end)
    reason: str
    min_cosine: float | None  # the worst token's (None when the node gave no usable answer)
    required_cosine: float | None
    max_rel_norm: float | None
    allowed_rel_norm: float | None
    chart: charts.TokenChart | None  # per-token cosine against the required value
    sent_at: datetime | None
    deadline_at: datetime | None
    answered_at: datetime | None
    latency_ms: float | None  # from sending to the answer's arrival
    elapsed_ms: float | None  # the session's first FORWARD to its last RESULT, timed by the control plane
    job_finished_at: datetime | None
    checked_at: datetime | None


def evidence_of(strike: Strike) -> Evidence:
    found = strike.evidence or {}
    cosine = [v for v in found.get("cosine") or [] if _number(v) is not None]
    required = _number(found.get("required_cosine"))
    layers = found.get("layers")
    sent, answered = _moment(found.get("sent_at")), _moment(found.get("answered_at"))
    chart = None
    if cosine and required is not None:
        chart = charts.token_chart(f"Cosine similarity per token (required {required:g})", cosine, required)
    return Evidence(
        kind=str(found.get("kind") or strike.kind),
        seed=str(found.get("seed") or ""),
        tokens=found.get("tokens") if isinstance(found.get("tokens"), int) else None,
        job=str(found.get("job") or ""),
        session=str(found.get("session") or ""),
        stage=found.get("stage") if isinstance(found.get("stage"), int) else None,
        model=str(found.get("model") or ""),
        layers=(int(layers[0]), int(layers[1])) if isinstance(layers, list) and len(layers) == 2 else None,
        reason=str(found.get("reason") or ""),
        min_cosine=_number(found.get("min_cosine")),
        required_cosine=required,
        max_rel_norm=_number(found.get("max_rel_norm")),
        allowed_rel_norm=_number(found.get("allowed_rel_norm")),
        chart=chart,
        sent_at=sent,
        deadline_at=_moment(found.get("deadline_at")),
        answered_at=answered,
        latency_ms=_ms_between(sent, answered),
        elapsed_ms=_number(found.get("elapsed_ms")),
        job_finished_at=_moment(found.get("job_finished_at")),
        checked_at=_moment(found.get("checked_at")),
    )


@dataclass(frozen=True)
class StrikeView:
    strike: Strike
    evidence: Evidence
    review_by: datetime | None  # an open strike is upheld automatically at this time


def strike_view(strike: Strike) -> StrikeView:
    review_by = None
    if strike.state == StrikeState.OPEN:
        review_by = strike.created_at + timedelta(seconds=settings.SWARM_STRIKE_REVIEW_S)
    return StrikeView(strike, evidence_of(strike), review_by)


@dataclass(frozen=True)
class CheckRow:
    check: Challenge | Audit
    latency_ms: float | None  # challenges: from sending to the answer
    min_cosine: float | None
    max_rel_norm: float | None


def _check_row(check: Challenge | Audit) -> CheckRow:
    metrics = check.metrics or {}
    latency = _ms_between(check.sent_at, check.answered_at) if isinstance(check, Challenge) else None
    return CheckRow(check, latency, _number(metrics.get("min_cosine")), _number(metrics.get("max_rel_norm")))


@dataclass(frozen=True)
class NodeTrust:
    node: Node
    score: float
    computed: bool  # the reputation was computed at least once (else the node's starting value)
    components: list[Component]
    explanation: list[str]
    checks_explanation: str
    audit_fraction: float  # of the node's sessions
    challenges_per_day: float
    rates_are_defaults: bool  # not computed yet: a new node's rates apply
    strikes: list[StrikeView]
    challenges: list[CheckRow]
    audits: list[CheckRow]
    in_flight: bool  # a check awaits its answer or its replay


def node_trust(node: Node) -> NodeTrust:
    detail = node.reputation_detail or {}
    values = detail.get("components") or {}
    components = [
        Component(label, values[key], share) for key, label, share in COMPONENTS if _number(values.get(key)) is not None
    ]
    challenges = list(Challenge.objects.filter(node=node).order_by("-sent_at", "-pk")[:RECENT_CHECKS])
    audits = list(Audit.objects.filter(node=node).select_related("job").order_by("-created_at", "-pk")[:RECENT_CHECKS])
    strikes = Strike.objects.filter(node=node).select_related("decided_by").order_by("-created_at", "-pk")
    in_flight = (
        Challenge.objects.filter(node=node, state__in=[CheckState.SENT, CheckState.ANSWERED]).exists()
        or Audit.objects.filter(node=node, state=CheckState.PENDING).exists()
    )
    defaults = node.audit_fraction is None or node.challenges_per_day is None
    return NodeTrust(
        node=node,
        score=node.reputation,
        computed=bool(detail),
        components=components,
        explanation=[str(line) for line in detail.get("explanation") or []],
        checks_explanation=str(detail.get("checks") or ""),
        audit_fraction=settings.SWARM_AUDIT_NEW_NODE_FRACTION if node.audit_fraction is None else node.audit_fraction,
        challenges_per_day=(
            settings.SWARM_CHALLENGES_MIN_PER_DAY if node.challenges_per_day is None else node.challenges_per_day
        ),
        rates_are_defaults=defaults,
        strikes=[strike_view(strike) for strike in strikes],
        challenges=[_check_row(c) for c in challenges],
        audits=[_check_row(a) for a in audits],
        in_flight=in_flight,
    )


# --- earnings and payouts -------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectStatus:
    key: str  # none, started, submitted, ready
    text: str


def connect_status(connect: ConnectAccount | None) -> ConnectStatus:
    if connect is None:
        return ConnectStatus("none", "no Stripe account connected")
    if connect.payouts_enabled:
        return ConnectStatus("ready", "ready to receive payouts")
    if connect.details_submitted:
        return ConnectStatus("submitted", "details submitted; Stripe has not enabled transfers yet")
    return ConnectStatus("started", "onboarding not finished")


@dataclass(frozen=True)
class EarningsView:
    summary: dict[str, int]  # nano-dollars: pending, available, paid, clawed_back
    days: list[dict]  # one per day of the window, oldest first: day, amount (nano-dollars), jobs
    chart: charts.BarChart
    # Per day with earnings (newest first), its total then each node's: day, node (pk; None on a
    # day's total row), node_name, amount (nano-dollars), jobs.
    rollup: list[dict]
    recent: list[Earning]  # the per-request rows: the latest, or those of ``showing``
    showing: dict | None  # the day (and node) whose per-request rows ``recent`` holds: day, node, node_name
    payouts: list[Payout]
    connect: ConnectAccount | None
    connect_status: ConnectStatus


def owns_node(provider, node: int) -> bool:
    return Node.objects.filter(pk=node, owner=provider).exists()


def earnings_view(
    provider, now: datetime | None = None, *, day: date | None = None, node: int | None = None
) -> EarningsView:
    """The provider's earnings page; with ``day`` (and ``node``, a node's pk), the per-request rows
    are that day's (of that node) rather than the latest."""
    now = now or timezone.now()
    # Each day's total and each node's part, from one query; the chart's days are the same totals.
    rollup: list[dict] = []
    totals: dict[date, dict] = {}
    for node_row in payouts.earnings_by_day_and_node(provider, days=EARNINGS_DAYS, now=now):
        if node_row["day"] not in totals:
            totals[node_row["day"]] = {"day": node_row["day"], "node": None, "node_name": "", "amount": 0, "jobs": 0}
            rollup.append(totals[node_row["day"]])
        totals[node_row["day"]]["amount"] += node_row["amount"]
        totals[node_row["day"]]["jobs"] += node_row["jobs"]
        rollup.append(node_row)
    today = timezone.localdate(now)
    days: list[dict[str, Any]] = []
    for back in range(EARNINGS_DAYS - 1, -1, -1):
        that_day = today - timedelta(days=back)
        row = totals.get(that_day, {})
        days.append({"day": that_day, "amount": row.get("amount") or 0, "jobs": row.get("jobs") or 0})
    chart = charts.bar_chart(
        f"Earnings per day, last {EARNINGS_DAYS} days (USD)",
        [(d["day"].strftime("%m-%d"), float(dollars(d["amount"])), nano_detail(d["amount"])) for d in days],
        width=640,
        height=240,
        tick=charts.dollar_tick,
    )
    rows = Earning.objects.filter(provider=provider).select_related("job", "node")
    showing: dict[str, Any] | None = None
    if day is not None:
        rows = rows.filter(created_at__date=day)
        showing = {"day": day, "node": None, "node_name": ""}
        if node is not None:
            rows = rows.filter(node_id=node)
            showing.update(node=node, node_name=Node.objects.filter(pk=node).values_list("name", flat=True).first())
    connect = ConnectAccount.objects.filter(provider=provider).first()
    return EarningsView(
        summary=payouts.earnings_summary(provider),
        days=days,
        chart=chart,
        rollup=rollup,
        recent=list(rows.order_by("-created_at", "-pk")[:RECENT_ROWS]),
        showing=showing,
        payouts=list(payouts.payout_history(provider)[:RECENT_ROWS]),
        connect=connect,
        connect_status=connect_status(connect),
    )


# --- admins ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdminTodo:
    """What awaits an admin: the admin home's to-do list."""

    open_strikes: int
    struck_nodes: int  # nodes with an open strike
    batches_awaiting: int  # payout batches built, awaiting approval
    awaiting_total: int  # nano-dollars in those batches
    flagged_payouts: int  # transfers that failed for good
    offline_nodes: int
    ejected_nodes: int

    @property
    def decisions_due(self) -> bool:
        """Strikes or batches wait for an admin's decision (flags and node states are for reading)."""
        return bool(self.open_strikes or self.batches_awaiting)


def admin_todo() -> AdminTodo:
    strikes = Strike.objects.filter(state=StrikeState.OPEN).aggregate(n=Count("id"), nodes=Count("node", distinct=True))
    batches = PayoutBatch.objects.filter(state=BatchState.BUILT).aggregate(n=Count("id"), total=Sum("total"))
    states = dict(Node.objects.filter(deleted_at__isnull=True).values_list("state").annotate(n=Count("id")))
    return AdminTodo(
        open_strikes=strikes["n"],
        struck_nodes=strikes["nodes"],
        batches_awaiting=batches["n"],
        awaiting_total=batches["total"] or 0,
        flagged_payouts=Payout.objects.filter(flagged=True).count(),
        offline_nodes=states.get(NodeState.OFFLINE, 0),
        ejected_nodes=states.get(NodeState.EJECTED, 0),
    )


def strike_by_pk(pk: int) -> Strike | None:
    return Strike.objects.select_related("node").filter(pk=pk).first()


def batch_by_pk(pk: int) -> PayoutBatch | None:
    return PayoutBatch.objects.filter(pk=pk).first()


@dataclass(frozen=True)
class NodeStrikes:
    node: Node
    strikes: list[StrikeView]  # its open strikes, oldest first


def strike_queue() -> tuple[list[NodeStrikes], list[StrikeView]]:
    """Open strikes grouped by node, the node whose oldest strike is upheld automatically first
    coming first; and the latest decided strikes."""
    base = Strike.objects.select_related("node", "node__owner", "decided_by")
    groups: dict[int, NodeStrikes] = {}
    for strike in base.filter(state=StrikeState.OPEN).order_by("created_at", "pk"):
        groups.setdefault(strike.node_id, NodeStrikes(strike.node, [])).strikes.append(strike_view(strike))
    decided = base.exclude(state=StrikeState.OPEN).order_by("-decided_at", "-pk")[:RECENT_ROWS]
    return list(groups.values()), [strike_view(s) for s in decided]


@dataclass(frozen=True)
class PayoutRow:
    payout: Payout
    connect: ConnectStatus


@dataclass(frozen=True)
class BatchView:
    batch: PayoutBatch
    rows: list[PayoutRow]


@dataclass(frozen=True)
class DueRow:
    provider: str
    amount: int  # nano-dollars available and not yet in a batch
    earnings: int
    connect: ConnectStatus
    due: bool  # goes into the next batch: above the minimum, with a payout-ready account


@dataclass(frozen=True)
class PayoutsView:
    awaiting: list[BatchView]  # built, awaiting an admin's approval
    recent: list[PayoutRow]  # approved, sent or failed, newest first
    flagged: int
    due: list[DueRow]
    minimum: int  # nano-dollars


def payouts_view() -> PayoutsView:
    connects = {c.provider_id: c for c in ConnectAccount.objects.all()}
    awaiting = []
    for batch in PayoutBatch.objects.filter(state=BatchState.BUILT).order_by("created_at", "pk"):
        payouts_ = batch.payouts.select_related("provider").order_by("provider__username", "pk")
        rows = [PayoutRow(p, connect_status(connects.get(p.provider_id))) for p in payouts_]
        awaiting.append(BatchView(batch, rows))
    recent = Payout.objects.exclude(state=PayoutState.PENDING).select_related("provider", "batch")
    recent = recent.order_by("-created_at", "-pk")[:RECENT_ROWS]
    available = (
        Earning.objects.filter(state=EarningState.AVAILABLE, payout__isnull=True)
        .values("provider_id", "provider__username")
        .annotate(total=Sum("amount"), n=Count("id"))
        .order_by("provider__username")
    )
    due = []
    for row in available:
        status = connect_status(connects.get(row["provider_id"]))
        enough = row["total"] >= settings.SWARM_PAYOUT_MINIMUM
        due.append(DueRow(row["provider__username"], row["total"], row["n"], status, enough and status.key == "ready"))
    return PayoutsView(
        awaiting=awaiting,
        recent=[PayoutRow(p, connect_status(connects.get(p.provider_id))) for p in recent],
        flagged=Payout.objects.filter(flagged=True).count(),
        due=due,
        minimum=settings.SWARM_PAYOUT_MINIMUM,
    )
