"""Joining the swarm: a node's one-time join token, the agent's join with it (proof of its key,
its hardware, a TLS certificate for its data plane), and the handshake of its control channel.

A token is stored only as its sha256, shown once, and used once: a join binds the agent's key to
the node; a join posted again because its answer was lost is recognised for JOIN_RETRY_WINDOW_S.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import IntegrityError, transaction
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
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.reports import number
from worker_agent.protocol.control_protocol import CONTROL_CONTEXT, JOIN_CONTEXT
from worker_agent.protocol.keys import node_id as node_id_of

TOKEN_PREFIX = "swj_"
MAX_POSITIONS = 1 << 20  # the most positions per session an agent may report holding
MAX_SESSIONS = 4096  # the most sessions at once an agent may report holding
JOIN_RETRY_WINDOW_S = 600  # how long after a join the same key may post it again (its answer was lost)
JOIN_CHECK_WINDOW_S = 60  # failed token checks are counted per address in windows this long


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
    memory = number(hardware, "memory_bytes", minimum=1, maximum=2**62)  # fits a bigint
    max_layers = number(hardware, "max_layers", minimum=1, maximum=100_000, required=False)
    max_positions = number(hardware, "max_positions", minimum=1, maximum=MAX_POSITIONS, required=False)
    if max_positions is not None and not isinstance(hardware["max_positions"], int):
        raise InvalidReport(f"max_positions must be an integer, got {hardware['max_positions']!r}")
    max_sessions = number(hardware, "max_sessions", minimum=1, maximum=MAX_SESSIONS, required=False)
    if max_sessions is not None and not isinstance(hardware["max_sessions"], int):
        raise InvalidReport(f"max_sessions must be an integer, got {hardware['max_sessions']!r}")
    compute = number(benchmark, "layer_tokens_per_s", minimum=1e-9)
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
    node.memory_limit_bytes = node.verified_memory_bytes = None  # measured of the report this join replaces
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
