"""Capacity claims checked against what was measured: a node's word about itself that a measurement
contradicts past a tolerance is a ``capacity`` strike (one open at a time per kind of claim, with the
claim and the measurement as evidence). Placement and routing already clamp such a claim to what
was measured; the strike is what makes lying cost more than it could win.

- speed: ``strikes.strike_false_capacity_claim``, after a passed challenge proved a speed;
- round trips: ``record_probe_results``, each link measured from both ends
  (``placement.round_trips``);
- memory for the KV cache, as positions per session: ``refused_positions``, a stage that refused a
  session for its length although it reported holding more;
- memory, in bytes: ``failed_to_hold``, a memory challenge (``memory_ask``) whose sessions the node
  refused or dropped within the KV budget its blocks were placed with. The node holds less than the
  positions it was asked by then (the refused step's included) plus those of the other sessions it
  had open (its heartbeats' count when the challenge was opened or judged, the larger, each counted
  at its full length), so its memory counts as no more than what those need
  (``nodes.services.clamp_memory``); a report past SWARM_MEMORY_CLAIM_TOLERANCE times that is a
  strike. A passed one records what it proved (``held_memory``).
"""

from __future__ import annotations

import math

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace.nodes.models import LinkMeasurement, Node
from marketplace.nodes.services import clamp_memory, clamp_positions, record_links, record_verified_memory
from marketplace.placement.memory import memory_holding
from marketplace.placement.models import Assignment
from marketplace.placement.round_trips import FalseRoundTrip, false_claims, liars
from marketplace.placement.shares import layer_footprint
from marketplace.verification.models import Challenge, CheckState, Strike, StrikeKind, StrikeState
from marketplace.verification.strikes import open_strike

MEMORY_DECODE_TOKENS = 4  # tokens each session of a memory challenge generates over its prompt

# Distinct peers whose own measurements must contradict a node's reports before it is struck: one
# hostile peer could inflate its report of a link to frame an honest node (a trusted peer suffices).
RTT_WITNESSES = 2


@transaction.atomic
def record_probe_results(node_pk: int, results: list) -> list[Strike]:
    """Store an agent's link measurements (``nodes.services.record_links``), then cross-check every
    link between it and another node against the other end's report: a node whose reports enough
    peers contradict (``placement.round_trips.liars``), this one or a peer its new measurements
    contradict, gets a strike. Returns the strikes opened."""
    record_links(node_pk, results)
    node_id = Node.objects.values_list("node_id", flat=True).get(pk=node_pk)
    mine = LinkMeasurement.objects.filter(source_id=node_pk).exclude(target__startswith="region:")
    peers = set(mine.values_list("target", flat=True))
    # Every report between those peers and anyone: a peer's other links are its other witnesses.
    rows = LinkMeasurement.objects.filter(source__node_id__in=peers | {node_id}).exclude(target__startswith="region:")
    reports, evidence = {}, {}
    for source, target, rtt, lowest, samples in rows.values_list(
        "source__node_id", "target", "rtt_ms", "lowest_rtt_ms", "samples"
    ):
        assert source is not None  # the rows are filtered by their source's node id
        reports[(source, target)] = rtt
        if lowest is not None and samples >= settings.SWARM_RTT_EVIDENCE_SAMPLES:
            evidence[(source, target)] = lowest
    false = false_claims(
        reports,
        tolerance=settings.SWARM_RTT_CLAIM_TOLERANCE,
        margin_ms=settings.SWARM_RTT_CLAIM_MARGIN_MS,
        evidence=evidence,
    )
    trusted = {
        trusted_id
        for trusted_id in Node.objects.filter(node_id__in=peers | {node_id}, trusted_at__isnull=False).values_list(
            "node_id", flat=True
        )
        if trusted_id is not None  # always: filtered by node id
    }
    return [
        strike
        for liar, claims in sorted(liars(false, trusted=trusted, witnesses=RTT_WITNESSES).items())
        if (strike := _strike_round_trips(liar, claims)) is not None
    ]


def _strike_round_trips(node_id: str, claims: list[FalseRoundTrip]) -> Strike | None:
    node = Node.objects.get(node_id=node_id)
    if _open_strike_of(node, "rtt"):
        return None
    links = ", ".join(f"{c.target}: {c.claimed_ms:g} ms where it measured {c.measured_ms:g} ms" for c in claims)
    return open_strike(
        node,
        str(StrikeKind.CAPACITY),
        evidence={
            "kind": "rtt",
            "reason": f"reports round trips far below what the other ends measured ({links})",
            "links": [{"target": c.target, "claimed_ms": c.claimed_ms, "measured_ms": c.measured_ms} for c in claims],
        },
    )


@transaction.atomic
def refused_positions(node_id: str, reached: int, *, job) -> Strike | None:
    """``node_id``'s stage refused ``job``'s session for its length (``session_too_long``), the
    session reaching at most ``reached`` positions (its prompt and max tokens): the node holds
    fewer than that per session. Reported holding as many (``max_positions``, which admission lets
    requests use), its report is clamped to ``reached - 1`` (``nodes.services.clamp_positions``);
    one past SWARM_MEMORY_CLAIM_TOLERANCE times that is a strike, with the job as evidence."""
    node = Node.objects.filter(node_id=node_id).first()
    if node is None or not node.max_positions or node.max_positions < reached:
        return None  # refused past what it reported: its report was true
    claimed, held = node.max_positions, reached - 1
    clamp_positions(node.pk, held)
    if claimed <= settings.SWARM_MEMORY_CLAIM_TOLERANCE * held:
        return None
    if _open_strike_of(node, "memory"):
        return None
    return open_strike(
        node,
        str(StrikeKind.CAPACITY),
        job=job,
        evidence={
            "kind": "memory",
            "reason": f"reports holding {claimed} positions per session, but refused a session of at most {reached}",
            "claimed_positions": claimed,
            "refused_at_most": reached,
            "job": job.public_id,
        },
    )


def memory_ask(node: Node, assignment: Assignment) -> tuple[int, int]:
    """What a memory challenge of ``assignment`` asks ``node`` to hold at once: (sessions, positions
    per session), SWARM_MEMORY_CHALLENGE_FRACTION of the KV budget its blocks were placed with
    (``placement.shares.layer_footprint``), over as many sessions as the budget has."""
    layer = layer_footprint(node, assignment.model)
    positions = math.ceil(settings.SWARM_MEMORY_CHALLENGE_FRACTION * layer.positions)
    return layer.sessions, max(positions, MEMORY_DECODE_TOKENS + 1)


def held_memory(challenge: Challenge, positions: int) -> int:
    """A passed memory challenge: the node held ``positions`` positions on its span at once. Records
    the memory that proves (its blocks' weights and those caches) and returns it."""
    node = challenge.node
    proven = memory_holding(
        layer_footprint(node, challenge.model), challenge.layer_end - challenge.layer_start, positions
    )
    record_verified_memory(node.pk, proven)
    return proven


@transaction.atomic
def failed_to_hold(challenge_pk: int, asked: int, reason: str) -> Challenge:
    """A memory challenge whose sessions the node refused or dropped (see the module) once it had
    been sent ``asked`` positions: failed, the node's memory clamped, and struck past the tolerance.
    One already decided is left as it is."""
    challenge = Challenge.objects.select_for_update().select_related("node").get(pk=challenge_pk)
    if challenge.state != CheckState.SENT:
        return challenge
    node, now = challenge.node, timezone.now()
    layer, layers = layer_footprint(node, challenge.model), challenge.layer_end - challenge.layer_start
    others = max(open_sessions(node), int(challenge.metrics.get("open_sessions", 0)))
    customers = others * layer.positions
    limit = memory_holding(layer, layers, max(asked - 1, 0) + customers)
    challenge.state, challenge.checked_at = CheckState.FAILED, now
    challenge.reason = (
        f"did not hold {asked} positions over {challenge.sessions} sessions on layers "
        f"{challenge.layer_start}:{challenge.layer_end}: {reason}"
    )[:1000]
    challenge.metrics = {
        **challenge.metrics,
        "asked_positions": asked,
        "other_sessions": others,
        "memory_limit_bytes": limit,
    }
    challenge.save()
    clamp_memory(node.pk, limit)
    if node.memory_bytes <= settings.SWARM_MEMORY_CLAIM_TOLERANCE * limit or _open_strike_of(node, "memory"):
        return challenge
    open_strike(
        node,
        str(StrikeKind.CAPACITY),
        challenge=challenge,
        evidence={
            "kind": "memory",
            "reason": (
                f"reports {node.memory_bytes} bytes of memory, {node.memory_bytes / limit:.2f}x the {limit} "
                f"that would hold the {asked} positions its memory challenge sent it on {layers} layers "
                f"(with {customers} for the {others} other sessions it had open), which it did not hold"
            ),
            "claimed_memory_bytes": node.memory_bytes,
            "memory_limit_bytes": limit,
            "asked_positions": asked,
            "other_sessions": others,
            "challenge": challenge.pk,
        },
    )
    return challenge


def open_sessions(node: Node) -> int:
    """The sessions ``node``'s agent said it had open in its last heartbeat (0 when it did not say)."""
    sessions = (node.load or {}).get("sessions")
    return int(sessions) if isinstance(sessions, int | float) and 0 <= sessions < 2**31 else 0


def _open_strike_of(node: Node, claim: str) -> bool:
    """Whether a capacity strike for the same kind of claim is open on ``node``: one false claim,
    one strike, however often the node repeats it."""
    strikes = Strike.objects.filter(node=node, kind=StrikeKind.CAPACITY, state=StrikeState.OPEN)
    return strikes.filter(evidence__kind=claim).exists()
