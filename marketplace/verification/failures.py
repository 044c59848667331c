"""Attributed failures: what a node costs the jobs it fails is counted, routed around, and struck.

A job's coordinator attributes a failure to one node only on its own observation or on evidence the
node signed (``worker_agent/coordinator/pipeline.py``): the stage that put out nothing for a step
even when the coordinator handed it its input itself (a stall), whose connection dropped, which
refused the coordinator's own frames, or which owed a receipt it never sent. A neighbour's word
never makes one. ``record_failure`` is called for each: by a heal (``jobs.services.heal_job``) for
the node it routes around, and by the job's runner for its verification culprit.

Each failure counts in the node's current window (SWARM_FAILURE_WINDOW_S from the window's first
failure; a failure after it starts a new window) and keeps requests off the node for

    SWARM_FAILURE_BACKOFF_S * 2^(n - 1) seconds, at most SWARM_FAILURE_BACKOFF_MAX_S

from the failure, n the window's count so far (``backoff_s``), wherever a chain of other nodes
covers the model: where none does, the node is routed as a last resort rather than leave the model
without a route (``placement.selectors.backed_off``). Unlike a suspicion, which the node's next
heartbeat clears, no heartbeat or reconnect shortens it. One event fails every job the node
was serving at once (a crash fails fifty streams within a second): the failures attributed within
SWARM_FAILURE_INCIDENT_S of the last counted one are the same incident, counted once.

Churn is normal, and a crash, a restart or a freeze looks from the data plane like a stall or a
drop: so only a failure of a node that stayed alive through it (``alive_through``: its agent kept
the control channel it had before the job, and heartbeats on it now) is *deliberate*, and a lost
connection never is (a dead process drops it too). The deliberate failure that takes a window past
SWARM_FAILURES_BEFORE_STRIKE of them opens one ``failures`` strike (once per window), with that job
as its evidence: a node that stalls again and again while it answers its heartbeats is reviewed
like one that cheats, and an honest node that crashes or freezes is only routed around.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node
from marketplace.verification.models import Strike, StrikeKind
from marketplace.verification.strikes import open_strike

log = logging.getLogger("swarm.verification")

MAX_DOUBLINGS = 40  # 2^40 times any base is past every cap: the exponent stops growing there


def backoff_s(failures: int) -> float:
    """How long a node with ``failures`` (>= 1) in its current window is kept off routing, in seconds."""
    doubled = settings.SWARM_FAILURE_BACKOFF_S * 2 ** min(max(failures, 1) - 1, MAX_DOUBLINGS)
    return min(doubled, settings.SWARM_FAILURE_BACKOFF_MAX_S)


# A lost or unreachable connection: what a crashed, killed or restarted agent leaves too.
GONE_CODES = frozenset({"stage_lost", "stage_unreachable", "next_unreachable", "close_unanswered"})


def failure_code(reason: str) -> str:
    """The code of a failure's reason: ``code: message`` (a heal's) or ``message (...; code)`` (a
    verification error's)."""
    reason = reason.strip()
    if reason.endswith(")") and "(" in reason:
        return reason[reason.rindex("(") + 1 : -1].split(";")[-1].strip()
    return reason.partition(":")[0].strip()


def alive_through(node: Node, job, now: datetime) -> bool:
    """Whether ``node``'s agent was up all through ``job`` until ``now``: the control channel it has
    now opened before the job started, and its last heartbeat is at most 1.5 heartbeat intervals old
    (a frozen process misses them; a crashed or restarted one has lost or reopened its channel)."""
    started = job.started_at or job.created_at
    fresh = timedelta(seconds=1.5 * settings.SWARM_HEARTBEAT_INTERVAL_S)
    return bool(
        node.connected
        and node.connected_since is not None
        and started is not None
        and node.connected_since <= started
        and node.last_heartbeat_at is not None
        and now - node.last_heartbeat_at <= fresh
    )


@transaction.atomic
def record_failure(node_id: str, reason: str, *, job, now: datetime | None = None) -> Strike | None:
    """Count a failure of ``job`` that its coordinator attributed to ``node_id`` (see the module's
    docstring): the node's window count grows (once per incident), routing backs off, and the
    deliberate failure that takes the window past SWARM_FAILURES_BEFORE_STRIKE of them opens a
    ``failures`` strike, which is returned. None (and nothing counted) for a node that is not on the
    job's route."""
    if node_id not in {stage["node"] for stage in job.route}:
        return None
    node = Node.objects.select_for_update().filter(node_id=node_id).first()
    if node is None:
        return None
    now = now or timezone.now()
    deliberate = failure_code(reason) not in GONE_CODES and alive_through(node, job, now)
    incident = timedelta(seconds=settings.SWARM_FAILURE_INCIDENT_S)
    if node.last_failure_at is not None and timedelta(0) <= now - node.last_failure_at < incident:
        # The same incident as the last counted failure: keep the later reason, count nothing more,
        # unless this one shows the node alive where the first could not.
        if not deliberate or node.recent_deliberate:
            Node.objects.filter(pk=node.pk).update(last_failure=str(reason)[:255])
            return None
        recent, since = node.recent_failures, node.failures_since
        counted = 0
    else:
        window = timedelta(seconds=settings.SWARM_FAILURE_WINDOW_S)
        if node.failures_since is None or now - node.failures_since >= window:
            recent, since = 1, now
            node.recent_deliberate = 0
        else:
            recent, since = node.recent_failures + 1, node.failures_since
        counted = 1
    chosen = node.recent_deliberate + int(deliberate)
    until = now + timedelta(seconds=backoff_s(recent))
    Node.objects.filter(pk=node.pk).update(
        recent_failures=recent,
        recent_deliberate=chosen,
        failures_since=since,
        failures_total=F("failures_total") + counted,
        routing_backoff_until=until,
        last_failure=str(reason)[:255],
        last_failure_at=now,
    )
    log.warning(
        "node %s: failure %d of its window (%s) in job %s (%s); not routed until %s",
        node_id,
        recent,
        "alive through it" if deliberate else "churn or a lost connection",
        job.public_id,
        reason,
        until.isoformat(timespec="seconds"),
    )
    notify_node_changed(node.pk)
    if not deliberate or chosen != settings.SWARM_FAILURES_BEFORE_STRIKE + 1:
        return None
    assert since is not None  # a counted failure sets failures_since with last_failure_at
    return open_strike(
        node,
        str(StrikeKind.FAILURES),
        job=job,
        evidence={
            "kind": "failures",
            "job": job.public_id,
            "reason": f"{chosen} failures attributed to it since {since.isoformat(timespec='seconds')} while "
            f"its agent answered its heartbeats; the latest: {reason}"[:2000],
            "failures": chosen,
            "since": since.isoformat(),
        },
    )
