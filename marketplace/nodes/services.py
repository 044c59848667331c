"""Node registry use cases: add, join, authenticate, connect, heartbeat, drain, eject, reinstate.

Agents talk to these through the join endpoint and the control channel; providers through the
API. Every state change is an atomic, conditional write; messages to agents go out on commit.
Changes that also move the swarm's blocks (a node connecting, coming back, going silent, draining,
ejected or deleted) are placement's verbs (``marketplace.placement.services``), which call these.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
from datetime import datetime, timedelta
from typing import Any, Literal, overload

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.cache import cache
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from marketplace.nodes.authority import issue_node_certificate
from marketplace.nodes.errors import (
    InvalidCsr,
    InvalidHandshake,
    InvalidJoinToken,
    InvalidReport,
    KeyAlreadyRegistered,
    NodeNameTaken,
    NodeNotAllowed,
    TooManyTokenChecks,
)
from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import LinkMeasurement, Node, NodeState, Reachability
from marketplace.nodes.reachability import relay_of, relay_offer
from worker_agent import control_protocol as protocol
from worker_agent.control_protocol import CONTROL_CONTEXT, JOIN_CONTEXT
from worker_agent.keys import node_id as node_id_of

log = logging.getLogger("swarm.nodes")

TOKEN_PREFIX = "swj_"
SPEED_SMOOTHING = 0.3  # weight of the newest measured speed in the node's running estimate
MAX_POSITIONS = 1 << 20  # the most positions per session an agent may report holding
MAX_SESSIONS = 4096  # the most sessions at once an agent may report holding
JOIN_RETRY_WINDOW_S = 600  # how long after a join the same key may post it again (its answer was lost)
JOIN_CHECK_WINDOW_S = 60  # failed token checks are counted per address in windows this long


def node_group(node_id: str) -> str:
    """The channel-layer group of a node's control channel."""
    return f"node.{node_id}"


def push(node_id: str, message: dict) -> None:
    """Send a control message to a node's agent once the current transaction commits."""

    def send() -> None:
        layer = get_channel_layer()
        if layer is not None:
            async_to_sync(layer.group_send)(node_group(node_id), {"type": "control.push", "message": message})

    transaction.on_commit(send)


def _hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _new_token() -> tuple[str, str]:
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, _hash_token(token)


@transaction.atomic
def create_node(*, owner, name: str, region: str = "local", max_layers: int | None = None) -> tuple[Node, str]:
    """Add a node for a provider; returns it with its one-time join token (shown once). ``max_layers``:
    the most layers it may hold at once, whatever its agent reports (None: as its memory allows)."""
    if not owner.is_provider:
        raise NodeNotAllowed("only providers can add nodes")
    if Node.objects.filter(owner=owner, name=name, deleted_at__isnull=True).exists():
        raise NodeNameTaken("You already have a node with this name.", param="name")
    token, token_hash = _new_token()
    expires = timezone.now() + timedelta(seconds=settings.SWARM_JOIN_TOKEN_TTL_S)
    node = Node.objects.create(
        owner=owner,
        name=name,
        region=region,
        join_token_hash=token_hash,
        join_token_expires_at=expires,
        layer_cap=max_layers,
        max_layers=max_layers,
    )
    return node, token


@transaction.atomic
def rotate_join_token(node: Node) -> str:
    """A fresh one-time join token (the old one stops working); the next join binds a new key."""
    token, token_hash = _new_token()
    expires = timezone.now() + timedelta(seconds=settings.SWARM_JOIN_TOKEN_TTL_S)
    Node.objects.filter(pk=node.pk).update(join_token_hash=token_hash, join_token_expires_at=expires)
    return token


def _check_public_key(public_key: str) -> bytes:
    try:
        raw = bytes.fromhex(public_key)
        VerifyKey(raw)
    except (ValueError, TypeError) as exc:
        raise InvalidReport("public_key must be 64 hex characters of an ed25519 key") from exc
    if len(raw) != 32:
        raise InvalidReport("public_key must be 64 hex characters of an ed25519 key")
    return raw


def _verify(public_key: bytes, message: bytes, signature_hex: str, error: type[Exception]) -> None:
    try:
        VerifyKey(public_key).verify(message, bytes.fromhex(signature_hex))
    except (BadSignatureError, ValueError, TypeError) as exc:
        raise error("the signature does not verify with the node's key") from exc


@overload
def _number(
    report: dict, key: str, *, minimum: float = ..., maximum: float = ..., required: Literal[True] = ...
) -> float: ...
@overload
def _number(report: dict, key: str, *, minimum: float = ..., maximum: float = ..., required: bool) -> float | None: ...
def _number(
    report: dict, key: str, *, minimum: float = 0.0, maximum: float = 1e15, required: bool = True
) -> float | None:
    value = report.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < minimum:
        raise InvalidReport(f"{key} must be a number >= {minimum}, got {value!r}")
    if value > maximum:
        raise InvalidReport(f"{key} must be at most {maximum:g}, got {value!r}")
    return float(value)


@transaction.atomic
def register_agent(
    *,
    token: str,
    public_key: str,
    signature: str,
    hardware: dict,
    benchmark: dict,
    data_url: str,
    agent_version: str = "",
    csr: str | None = None,
) -> Node:
    """An agent joins with a one-time token and proof that it holds the key it registers; one that
    serves TLS sends a CSR for its TLS key, and the swarm's CA certifies it (``tls_certificate``)."""
    raw_key = _check_public_key(public_key)
    if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX):
        raise InvalidJoinToken("the join token is not valid")
    _verify(raw_key, JOIN_CONTEXT + token.encode() + b"\0" + raw_key, signature, InvalidReport)
    token_hash = _hash_token(token)
    node = Node.objects.select_for_update().filter(join_token_hash=token_hash).first()
    if node is not None and (node.join_token_expires_at is None or node.join_token_expires_at < timezone.now()):
        node = None
    if node is None:
        node = _retried_join(token_hash, public_key.lower())
    if node is None:
        raise InvalidJoinToken("the join token is not valid (unknown, used or expired)")
    if node.state == NodeState.EJECTED:
        raise NodeNotAllowed("this node was ejected")
    if not (isinstance(data_url, str) and data_url.startswith(("ws://", "wss://")) and len(data_url) <= 255):
        raise InvalidReport("data_url must be a ws:// or wss:// URL")
    tls_certificate = _tls_certificate(csr, node=node_id_of(raw_key), data_url=data_url)
    memory = _number(hardware, "memory_bytes", minimum=1, maximum=2**62)  # fits a bigint
    max_layers = _number(hardware, "max_layers", minimum=1, maximum=100_000, required=False)
    max_positions = _number(hardware, "max_positions", minimum=1, maximum=MAX_POSITIONS, required=False)
    if max_positions is not None and not isinstance(hardware["max_positions"], int):
        raise InvalidReport(f"max_positions must be an integer, got {hardware['max_positions']!r}")
    max_sessions = _number(hardware, "max_sessions", minimum=1, maximum=MAX_SESSIONS, required=False)
    if max_sessions is not None and not isinstance(hardware["max_sessions"], int):
        raise InvalidReport(f"max_sessions must be an integer, got {hardware['max_sessions']!r}")
    compute = _number(benchmark, "layer_tokens_per_s", minimum=1e-9)
    dtypes = hardware.get("dtypes", [])
    if not isinstance(dtypes, list) or not all(isinstance(d, str) and 0 < len(d) <= 16 for d in dtypes):
        raise InvalidReport("dtypes must be a list of dtype names")
    node.public_key = public_key.lower()
    node.node_id = node_id_of(raw_key)
    node.used_join_token_hash = token_hash
    node.join_token_hash = None
    node.join_token_expires_at = None
    node.device = str(hardware.get("device", ""))[:16]
    node.device_name = str(hardware.get("device_name", ""))[:128]
    node.memory_bytes = int(memory)
    node.dtypes = dtypes[:8]
    node.max_layers = min((int(cap) for cap in (max_layers, node.layer_cap) if cap), default=None)
    node.max_positions = int(max_positions) if max_positions else None
    node.max_sessions = int(max_sessions) if max_sessions else None
    node.compute_layer_tokens_per_s = compute
    node.data_url = data_url
    node.tls_certificate = tls_certificate
    node.agent_version = str(agent_version)[:32]
    node.joined_at = timezone.now()
    node.connected = False  # until this agent opens its control channel
    node.suspected_at, node.suspicion = None, ""  # a report was about the previous agent process
    try:
        with transaction.atomic():
            node.save()
    except IntegrityError as exc:
        raise KeyAlreadyRegistered("this key is already registered to another node") from exc
    notify_node_changed(node.pk)
    return node


def _tls_certificate(csr: str | None, *, node: str, data_url: str) -> str:
    """The certificate for a join's CSR; "" for a plain ws:// data plane where the settings allow one."""
    secure = data_url.startswith("wss://")
    if csr is None:
        if secure:
            raise InvalidCsr(
                "a wss:// data plane needs a certificate from this control plane: send a CSR "
                "(swarm-worker join --tls auto)",
                param="csr",
            )
        if settings.SWARM_REQUIRE_DATA_TLS:
            raise InvalidCsr(
                "this control plane requires TLS on the data plane: send a CSR (swarm-worker join --tls auto)",
                param="csr",
            )
        return ""
    if not secure:
        raise InvalidReport("data_url must be a wss:// URL when a CSR is sent: the certificate serves TLS")
    return issue_node_certificate(csr, node=node, data_url=data_url)


def _retried_join(token_hash: str, public_key: str) -> Node | None:
    """The node this key joined with this token less than JOIN_RETRY_WINDOW_S ago, whose agent has
    not opened its control channel since: the same join posted again because its answer was lost
    (an agent retries a join that got no answer). None otherwise: the token was used."""
    node = (
        Node.objects.select_for_update()
        .filter(used_join_token_hash=token_hash, public_key=public_key, deleted_at__isnull=True)
        .first()
    )
    if node is None or node.joined_at is None:
        return None
    if (timezone.now() - node.joined_at).total_seconds() > JOIN_RETRY_WINDOW_S:
        return None
    if node.connected_since is not None and node.connected_since >= node.joined_at:
        return None
    return node


def check_join_token(token: str, *, address: str, now: datetime | None = None) -> Node:
    """The node ``token`` would join now, without using the token up (an agent asks before its
    benchmark); else ``InvalidJoinToken`` with its ``reason`` (unknown, used, expired), or
    ``NodeNotAllowed`` for an ejected node. The token is looked up by its sha256, as
    ``register_agent`` does, so how long an answer takes says nothing about how close a guess came.
    Failed checks are counted per client ``address``: past SWARM_JOIN_CHECK_FAILURES_PER_ADDRESS
    within a window of JOIN_CHECK_WINDOW_S, ``TooManyTokenChecks`` until the window ends."""
    now = now or timezone.now()
    window = int(now.timestamp() // JOIN_CHECK_WINDOW_S)
    key = token_check_failures_key(address, window)
    if cache.get(key, 0) >= settings.SWARM_JOIN_CHECK_FAILURES_PER_ADDRESS:
        wait = max(1, int((window + 1) * JOIN_CHECK_WINDOW_S - now.timestamp()))
        raise TooManyTokenChecks(f"Too many failed join token checks. Try again in {wait} seconds.", retry_after=wait)
    try:
        return _token_node(token, now)
    except InvalidJoinToken:
        cache.add(key, 0, timeout=JOIN_CHECK_WINDOW_S * 2)
        cache.incr(key)
        raise


def token_check_failures_key(address: str, window: int) -> str:
    """The cache key counting failed token checks from ``address`` in ``window``."""
    return f"join-check-fail:{address}:{window}"


def _token_node(token: str, now: datetime) -> Node:
    token_hash = _hash_token(token) if isinstance(token, str) and token.startswith(TOKEN_PREFIX) else None
    node = Node.objects.filter(join_token_hash=token_hash).first() if token_hash else None
    if node is None:
        if token_hash and Node.objects.filter(used_join_token_hash=token_hash, deleted_at__isnull=True).exists():
            raise InvalidJoinToken(
                "the join token was used already: a node joined with it. Rotate the node's token for a new "
                "one; an agent that joined with it reconnects without a token",
                reason="used",
            )
        raise InvalidJoinToken(
            "the join token is not known here: mistyped, replaced by a newer one, or its node deleted",
            reason="unknown",
        )
    expires = node.join_token_expires_at
    if expires is None or expires < now:
        when = f" at {expires.isoformat(timespec='seconds')}" if expires is not None else ""
        raise InvalidJoinToken(f"the join token expired{when}: rotate the node's token for a new one", reason="expired")
    if node.state == NodeState.EJECTED:
        raise NodeNotAllowed("this node was ejected")
    return node


def authenticate(*, node_id: str, nonce: bytes, signature: str) -> Node:
    """Check a control-channel handshake: the node's key signed this connection's fresh nonce."""
    node = Node.objects.filter(node_id=node_id).first() if isinstance(node_id, str) else None
    if node is None or not node.public_key:
        raise InvalidHandshake("unknown node")
    _verify(bytes.fromhex(node.public_key), CONTROL_CONTEXT + nonce + node_id.encode(), signature, InvalidHandshake)
    if node.state == NodeState.EJECTED:
        raise NodeNotAllowed("this node was ejected")
    if node.state == NodeState.DELETED:
        raise NodeNotAllowed("this node was deleted by its owner")
    return node


@transaction.atomic
def mark_connected(node_pk: int) -> tuple[Node, bool]:
    """The control channel is up: a pending or offline node becomes active, and a suspect one is
    cleared (its agent is alive and answered the handshake). Returns the node and whether it came
    online (placement's ``node_connected``, the verb callers use, re-places then)."""
    now = timezone.now()
    Node.objects.filter(pk=node_pk).update(
        connected=True, last_heartbeat_at=now, connected_since=now, suspected_at=None, suspicion=""
    )
    came_online = bool(
        Node.objects.filter(pk=node_pk, state__in=[NodeState.PENDING, NodeState.OFFLINE]).update(state=NodeState.ACTIVE)
    )
    node = Node.objects.get(pk=node_pk)
    notify_node_changed(node_pk)
    return node, came_online


def node_disconnected(node_pk: int, connected_at) -> None:
    """A channel opened at ``connected_at`` closed: the node becomes suspect at once (no new request
    is routed to it: its process may have died), and stays otherwise as it is until its heartbeats
    time out or it reconnects. A newer channel (the agent reconnected first) keeps it connected."""
    now = timezone.now()
    if Node.objects.filter(pk=node_pk, connected_since__lte=connected_at).update(connected=False):
        Node.objects.filter(
            pk=node_pk, state__in=[NodeState.ACTIVE, NodeState.DRAINING], suspected_at__isnull=True
        ).update(suspected_at=now, suspicion="its control channel closed")
        notify_node_changed(node_pk)


def record_reachability(node_pk: int, data_url: str, problem: str | None) -> protocol.UseRelay | None:
    """What the control plane found when it opened the data URL the node's agent reported
    (``reachability.reach``: ``problem`` None when it answered). An unreachable node's owner reads
    why on its page and in its agent's log; the agent gets the relays it may serve through
    (``reachability.relay_offer``), None when there are none."""
    node = Node.objects.only("node_id", "public_key").get(pk=node_pk)
    relay = relay_of(data_url, node.node_id or "")
    if problem is None:
        state = Reachability.RELAYED if relay is not None else Reachability.DIRECT
        detail = f"reached through relay {relay.id} at {data_url}" if relay is not None else f"reached at {data_url}"
    else:
        state, detail = Reachability.UNREACHABLE, problem
    Node.objects.filter(pk=node_pk).update(
        reachability=state,
        reachability_detail=detail[:2000],
        relay=relay.id if relay is not None and problem is None else "",
        reachability_checked_at=timezone.now(),
        # Where its links are measured from now on (probes name the node's URL).
        **({"data_url": data_url[:255]} if problem is None else {}),
    )
    notify_node_changed(node_pk)
    if problem is None:
        log.info("node %s %s", node.node_id, detail)
        return None
    log.warning("node %s is unreachable: %s", node.node_id, problem)
    return relay_offer(node.node_id or "", node.public_key or "", problem)


def mark_suspected(node_id: str, reason: str, now: datetime | None = None) -> bool:
    """A job's coordinator reports the node failed: it is suspect from ``now`` on (placement routes
    nothing to it). False when no active or draining node has that id."""
    updated = Node.objects.filter(node_id=node_id, state__in=[NodeState.ACTIVE, NodeState.DRAINING]).update(
        suspected_at=now or timezone.now(), suspicion=str(reason)[:255]
    )
    if updated:
        pk = Node.objects.only("pk").get(node_id=node_id).pk
        log.warning("node %s reported failed: %s", node_id, reason)
        notify_node_changed(pk)
    return bool(updated)


def _clears_suspicion(suspected_at: datetime | None, now: datetime) -> bool:
    """A heartbeat received more than one heartbeat interval after a failure report was sent after
    it: the node lives (it froze briefly, or only the coordinator's link to it failed). One that
    arrives sooner may have left before the failure, and proves nothing."""
    return suspected_at is not None and (now - suspected_at).total_seconds() > settings.SWARM_HEARTBEAT_INTERVAL_S


@transaction.atomic
def apply_heartbeat(node_pk: int, load: dict, now: datetime | None = None) -> bool:
    """Record a heartbeat's load, received at ``now``; True when it brought an offline node back
    (placement's ``record_heartbeat`` then asks for a new placement). A heartbeat clearly sent after
    a failure report clears the node's suspicion."""
    if not isinstance(load, dict):
        raise InvalidReport("load must be an object")
    clean: dict[str, Any] = {}  # numbers, and the model and state as text
    for key in ("sessions", "tokens_served", "uptime_s", "queue", "layer_ms"):
        if key in load:
            clean[key] = _number(load, key)
    for key in ("model", "state"):
        if key in load:
            clean[key] = str(load[key])[:64]
    now = now or timezone.now()
    node = Node.objects.only("compute_layer_tokens_per_s", "last_heartbeat_at", "suspected_at").get(pk=node_pk)
    updates = {"last_heartbeat_at": now, "load": clean, "connected": True}
    if _clears_suspicion(node.suspected_at, now):
        updates |= {"suspected_at": None, "suspicion": ""}
        log.info("node %s heartbeats after its failure report: no longer suspect", node_pk)
    if node.last_heartbeat_at is not None:
        # Uptime: the time since the previous heartbeat counts as online, up to two intervals
        # (a longer gap means the node was away for the rest of it).
        gap = (now - node.last_heartbeat_at).total_seconds()
        updates["online_s"] = F("online_s") + max(0.0, min(gap, 2 * settings.SWARM_HEARTBEAT_INTERVAL_S))
    if clean.get("layer_ms"):
        # The measured speed under real traffic replaces the join-time benchmark, smoothed.
        measured = 1000.0 / clean["layer_ms"]
        updates["compute_layer_tokens_per_s"] = SPEED_SMOOTHING * measured + (1 - SPEED_SMOOTHING) * (
            node.compute_layer_tokens_per_s or measured
        )
    Node.objects.filter(pk=node_pk).update(**updates)
    back = bool(Node.objects.filter(pk=node_pk, state=NodeState.OFFLINE).update(state=NodeState.ACTIVE))
    notify_node_changed(node_pk)
    return back


def clamp_positions(node_pk: int, positions: int) -> bool:
    """The node's stage refused a session for its length: it holds at most ``positions`` positions
    per session, whatever it reported (``max_positions``, which admission lets requests use). True
    when its report was higher; it stands until its agent joins again."""
    clamped = Node.objects.filter(pk=node_pk, max_positions__gt=positions).update(max_positions=max(positions, 1))
    if clamped:
        notify_node_changed(node_pk)
    return bool(clamped)


def mark_leaving(node_pk: int) -> bool:
    """The node's agent says it is stopping (SIGTERM, Ctrl-C), before it refuses any job: no
    request is routed to it from now on (placement routes only nodes whose control channel is up)
    and it gets no new block. Its agent is told it may stop taking jobs (a Drain, the answer it
    waits for). Its blocks stay assigned: a restarted agent confirms each one again. True when an
    active or draining node was marked."""
    if not Node.objects.filter(pk=node_pk, state__in=[NodeState.ACTIVE, NodeState.DRAINING]).update(connected=False):
        return False
    node_id = Node.objects.values_list("node_id", flat=True).get(pk=node_pk)
    assert node_id is not None  # an active or draining node has joined
    push(node_id, protocol.to_wire(protocol.Drain()))
    log.info("node %s is stopping: no new job is routed to it", node_id)
    notify_node_changed(node_pk)
    return True


def mark_draining(node: Node) -> bool:
    """An active or pending node takes no new work; its agent is told. True when it changed."""
    if not Node.objects.filter(pk=node.pk, state__in=[NodeState.ACTIVE, NodeState.PENDING]).update(
        state=NodeState.DRAINING
    ):
        return False
    if node.node_id:
        push(node.node_id, protocol.to_wire(protocol.Drain()))
    notify_node_changed(node.pk)
    return True


def mark_ejected(node: Node, *, reason: str, by=None) -> bool:
    """Mark a node ejected and tell its agent to stop; it cannot come back by itself. True when it changed.
    Placement's ``eject_node`` is the verb callers use: it also releases the node's blocks."""
    if by is not None and not by.is_staff:
        raise NodeNotAllowed("only admins eject nodes")
    if not (
        Node.objects.filter(pk=node.pk)
        .exclude(state__in=[NodeState.EJECTED, NodeState.DELETED])
        .update(state=NodeState.EJECTED, ejected_at=timezone.now(), ejection_reason=reason[:2000], connected=False)
    ):
        return False
    if node.node_id:
        push(node.node_id, protocol.to_wire(protocol.Stop(reason=f"ejected: {reason}"[: protocol.MAX_TEXT_CHARS])))
    log.warning("node %s ejected: %s", node.node_id, reason)
    notify_node_changed(node.pk)
    return True


def mark_deleted(node: Node) -> bool:
    """Soft-delete a node for its owner: it leaves every list of theirs and every placement and
    route, its agent cannot reconnect, and its join token stops working; the row stays for the
    jobs, earnings and strikes that name it. Placement's ``delete_node`` is the verb callers use.
    True when it changed."""
    if not Node.objects.filter(pk=node.pk, deleted_at__isnull=True).update(
        state=NodeState.DELETED,
        deleted_at=timezone.now(),
        connected=False,
        join_token_hash=None,
        join_token_expires_at=None,
    ):
        return False
    log.info("node %s deleted by its owner; kept for settlement", node.node_id)
    notify_node_changed(node.pk)
    return True


@transaction.atomic
def reinstate_node(node: Node, *, by) -> Node:
    """An admin lets an ejected node back: it rejoins as offline and becomes active when its agent
    reconnects (restarted by its owner)."""
    if by is None or not by.is_staff:
        raise NodeNotAllowed("only admins reinstate nodes")
    if Node.objects.filter(pk=node.pk, state=NodeState.EJECTED).update(
        state=NodeState.OFFLINE, ejected_at=None, ejection_reason=""
    ):
        notify_node_changed(node.pk)
    node.refresh_from_db()
    return node


@transaction.atomic
def record_links(node_pk: int, results: list) -> int:
    """Store the RTT/uplink an agent measured to the targets it can have been asked to probe:
    another node the control plane knows, or a configured coordinator region. Measurements of
    any other target are dropped, so a node holds at most one row per node and region (rows are
    upserted); returns how many were stored."""
    if not isinstance(results, list) or len(results) > protocol.MAX_ITEMS:
        raise InvalidReport(f"results must be a list of at most {protocol.MAX_ITEMS} measurements")
    parsed = []
    for result in results:
        if not isinstance(result, dict) or not isinstance(result.get("target"), str):
            raise InvalidReport("each measurement needs a target")
        parsed.append((result["target"], _number(result, "rtt_ms"), _number(result, "uplink_mbps", required=False)))
    regions = {f"region:{region}" for region in settings.SWARM_COORDINATOR_REGIONS}
    named = {target for target, _, _ in parsed if target not in regions}
    peers = set(Node.objects.filter(node_id__in=named).exclude(pk=node_pk).values_list("node_id", flat=True))
    now, stored = timezone.now(), 0
    for target, rtt, uplink in parsed:
        if target not in regions and target not in peers:
            continue
        before = LinkMeasurement.objects.filter(source_id=node_pk, target=target).first()
        lowest = rtt if before is None or before.lowest_rtt_ms is None else min(before.lowest_rtt_ms, rtt)
        LinkMeasurement.objects.update_or_create(
            source_id=node_pk,
            target=target,
            defaults={
                "rtt_ms": rtt,
                "lowest_rtt_ms": lowest,
                "samples": (before.samples if before is not None else 0) + 1,
                "uplink_mbps": uplink,
                "measured_at": now,
            },
        )
        stored += 1
        if uplink is not None and target in regions:
            Node.objects.filter(pk=node_pk).update(uplink_mbps=uplink)
    if stored < len(parsed):
        log.warning(
            "node %s: dropped %d measurements of targets it was never asked about", node_pk, len(parsed) - stored
        )
    return stored


def record_verified_speed(node_pk: int, layer_tokens_per_s: float) -> bool:
    """A speed the control plane measured itself (a passed challenge): the node's best one is kept.
    True when it is the node's best so far (its credible speed may have changed)."""
    if not (layer_tokens_per_s > 0):
        return False
    node = Node.objects.only("verified_layer_tokens_per_s").get(pk=node_pk)
    if node.verified_layer_tokens_per_s is None or layer_tokens_per_s > node.verified_layer_tokens_per_s:
        Node.objects.filter(pk=node_pk).update(verified_layer_tokens_per_s=layer_tokens_per_s)
        return True
    return False
