"""What a provider's node page says about one node in words: what its agent is doing now, what the
node has earned (and, when nothing, why), and where its reputation is heading."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count, Max, Sum

from marketplace.nodes.models import Node, NodeState
from marketplace.payouts.models import ConnectAccount, Earning, EarningState
from marketplace.placement.models import AssignmentState
from marketplace.verification.models import StrikeState
from marketplace.verification.reputation import AGE_FULL_DAYS, Track, rising_track

# --- the agent ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentStatus:
    key: str  # serving, spare, loading, idle, draining, suspect, disconnected, offline, ejected, not-joined
    text: str  # the sentence the node's page shows

    @property
    def label(self) -> str:
        """A word or two for a table cell or a badge."""
        return LABELS.get(self.key, self.key)


LABELS = {"suspect": "paused", "disconnected": "not connected", "not-joined": "not joined"}


def agent_status(node: Node, blocks: Sequence, reported: str) -> AgentStatus:
    """What the agent does now, from what the control plane knows rather than from the agent's last
    heartbeat alone (which a stopped agent never takes back): "serving" only while its control
    channel is up and it holds a ready block of a pipeline. ``blocks`` are its live assignments
    (``state``, ``spare``); ``reported`` is the state its last heartbeat gave."""
    if node.state == NodeState.EJECTED:
        return AgentStatus("ejected", "stopped: the node was ejected")
    if not node.node_id:
        return AgentStatus("not-joined", "not joined yet: run the join command on the machine")
    if node.state == NodeState.OFFLINE:
        return AgentStatus("offline", "offline: no heartbeat; start the agent again on the machine")
    if not node.connected:
        return AgentStatus("disconnected", "not connected: the agent stopped or lost its connection")
    if node.state == NodeState.DRAINING or reported == "draining":
        return AgentStatus("draining", "draining: finishing its work, taking no new requests")
    if node.suspected_at is not None:
        return AgentStatus("suspect", "paused: a request found it unresponsive; it gets none until its next heartbeat")
    ready = [b for b in blocks if b.state == AssignmentState.READY]
    if any(not b.spare for b in ready):
        return AgentStatus("serving", "serving requests in a pipeline")
    if ready:
        return AgentStatus("spare", "warm spare: ready to take over a block")
    if blocks:
        return AgentStatus("loading", "loading its block")
    return AgentStatus("idle", "idle: connected, no block assigned yet")


# --- earnings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reason:
    key: str  # not-placed, loading, spare, no-traffic, verifying, strike-open, payout-account-missing
    text: str


@dataclass(frozen=True)
class NodeEarnings:
    earned: int  # nano-dollars, every state but clawed back
    pending: int
    available: int  # available or in a payout batch
    paid: int
    clawed_back: int
    jobs: int  # verified requests it was paid for
    last_at: datetime | None
    reasons: list[Reason]  # why it earns nothing, or why its pay is held; empty when all is well


NOT_PLACED = {
    "not-joined": "Not placed: its agent has not joined yet. Run the join command on the machine.",
    "ejected": "Not placed: the node was ejected, so it gets no work.",
    "offline": "Not placed: the node is offline. Start the agent again on the machine.",
    "disconnected": "Not placed: its agent is not connected.",
    "draining": "Not placed: the node is draining and takes no new work.",
    "idle": (
        "Not placed: the swarm has not given it a block of a model yet. Placement runs every few "
        "seconds; a node too slow, or with too little memory for the layers that are needed, waits "
        "until the swarm needs it."
    ),
}


def _why_nothing(status: AgentStatus, blocks: Sequence, tokens_served: int | None) -> Reason:
    if status.key in NOT_PLACED:
        return Reason("not-placed", NOT_PLACED[status.key])
    if status.key == "loading":
        return Reason("loading", "Not serving yet: it is loading its block; it earns once it serves requests.")
    if status.key == "spare":
        spans = ", ".join(f"{b.model} layers {b.layer_start}–{b.layer_end}" for b in blocks if b.spare)
        return Reason(
            "spare",
            f"Spare: it holds a warm copy of {spans} and is sent requests only when a pipeline node "
            "fails or the swarm grows; a spare is paid for the requests it serves, not for waiting.",
        )
    if tokens_served:
        return Reason(
            "verifying",
            "Being verified: it has served requests; each is paid once its receipts are checked, "
            "seconds after it ends.",
        )
    if status.key == "suspect":
        return Reason("no-traffic", "No traffic: a request found it unresponsive, so none is routed to it for now.")
    return Reason(
        "no-traffic", "No traffic yet: it serves in a pipeline, but no request has been routed through it yet."
    )


def _held(node: Node) -> list[Reason]:
    """What holds back its pay even when it earns: an open strike, no account to pay into."""
    reasons = []
    if node.strikes.filter(state=StrikeState.OPEN).exists():
        reasons.append(
            Reason(
                "strike-open",
                "A strike is open: its pending pay is held until an admin decides (see below).",
            )
        )
    connect = ConnectAccount.objects.filter(provider_id=node.owner_id).first()
    if connect is None:
        reasons.append(
            Reason(
                "payout-account-missing",
                "Payout account missing: its earnings are kept for you, and paid out once you connect a "
                "Stripe account.",
            )
        )
    elif not connect.payouts_enabled:
        reasons.append(
            Reason(
                "payout-account-missing",
                "Payout account not ready: finish Stripe's onboarding so that your earnings can be paid out.",
            )
        )
    return reasons


def node_earnings(node: Node, status: AgentStatus, blocks: Sequence, tokens_served: int | None) -> NodeEarnings:
    rows = Earning.objects.filter(node=node)
    totals = dict(rows.values("state").annotate(total=Sum("amount")).values_list("state", "total"))
    paid_for = rows.exclude(state=EarningState.CLAWED_BACK).aggregate(jobs=Count("id"), last=Max("created_at"))
    amount = {state: totals.get(state) or 0 for state in EarningState.values}
    earned = sum(amount.values()) - amount[EarningState.CLAWED_BACK]
    reasons = [] if earned else [_why_nothing(status, blocks, tokens_served)]
    return NodeEarnings(
        earned=earned,
        pending=amount[EarningState.PENDING],
        available=amount[EarningState.AVAILABLE] + amount[EarningState.BATCHED],
        paid=amount[EarningState.PAID],
        clawed_back=amount[EarningState.CLAWED_BACK],
        jobs=paid_for["jobs"],
        last_at=paid_for["last"],
        reasons=reasons + _held(node),
    )


# --- reputation -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReputationTrack:
    """A computed reputation as progress: where it is, where age alone takes it, and by when."""

    score: float
    full: float  # where it reaches once age counts fully, the rest of its record unchanged
    per_day: float
    day: int  # of the AGE_FULL_DAYS that count (1 on its first day)
    full_at: datetime | None  # when age counts fully (None: it already does)
    progress: float  # score / full, for the bar
    raises: list[str]  # what else would raise it, in words


AGE_DAYS = int(AGE_FULL_DAYS)
SHOWN_AS_FULL = 0.9995  # a share the explanation shows as 100.0%: nothing to raise there


def reputation_track(node: Node) -> ReputationTrack | None:
    """None until the node's reputation is first computed (a new node's stored 1.0 is a placeholder)."""
    components = (node.reputation_detail or {}).get("components")
    if not components:
        return None
    track: Track = rising_track(components)
    joined = node.joined_at or node.created_at
    raises = []
    if components["check_pass_rate"] < SHOWN_AS_FULL:
        raises.append("Passing checks: every challenge and audit it passes raises its pass rate.")
    if components["reliability"] < SHOWN_AS_FULL:
        raises.append("Answering challenges in time: each one answered before its deadline counts.")
    if components["uptime"] < SHOWN_AS_FULL:
        raises.append("Staying online: uptime is the share of time since joining that it heartbeats.")
    if components["upheld_strikes"]:
        raises.append("Each upheld strike halves the score for good, so the track tops out lower.")
    day = min(AGE_DAYS, int(AGE_FULL_DAYS - track.days_left) + 1)
    return ReputationTrack(
        score=node.reputation,
        full=track.full,
        per_day=track.per_day,
        day=day,
        full_at=joined + timedelta(days=AGE_FULL_DAYS) if track.days_left > 0 else None,
        progress=min(node.reputation / track.full, 1.0) if track.full > 0 else 0.0,
        raises=raises,
    )
