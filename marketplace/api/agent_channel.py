"""The agent control channel (Channels WebSocket, JSON text frames typed by ``control_protocol``).

Handshake: the server sends a fresh random nonce; the agent answers with its node id and an
ed25519 signature over ``swarm-control-v1\\0 || nonce || node id``. A forged signature, an unknown
node or a replayed answer (signed over another connection's nonce) closes the channel with code
4401. The welcome tells the agent the address its channel came from (what it advertises when it
was given none). Then: heartbeats (with load) from the agent; assignments, drain, stop and probe
requests from the control plane; ready / failed / probe results from the agent. A block reported
ready enters placement only once the control plane has opened its data URL itself
(``nodes.reachability``); an agent nobody can reach is offered the relays (``use_relay``). Seeded
challenges travel the data plane (``marketplace.verification.challenges``).
Every frame is decoded by the protocol: a frame that is not a message at all closes the channel
(4400); a malformed message is answered with an error and the channel stays open.

Each channel is rate limited (a token bucket of ``SWARM_CONTROL_BURST`` messages refilled at
``SWARM_CONTROL_RATE_PER_S``): a message over the rate is answered with a ``rate_limited`` error
and not read; more than ``SWARM_CONTROL_MAX_REFUSED`` refusals in a row close the channel (4429).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from marketplace.jobs.route import open_jobs_on
from marketplace.nodes import joining, reachability, services
from marketplace.nodes.errors import InvalidHandshake, NodeError
from marketplace.nodes.tickets import issuer_public_key
from marketplace.placement import lifecycle, readiness
from marketplace.placement.errors import InvalidDataUrl
from marketplace.placement.models import Assignment
from marketplace.placement.selectors import assignments_of_node
from marketplace.verification import claims
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol.control_protocol import FRAMING_CODES, MessageType, ProtocolError

log = logging.getLogger("swarm.control")

CLOSE_UNAUTHORIZED = 4401
CLOSE_PROTOCOL = 4400
CLOSE_RATE_LIMITED = 4429
RATE_LIMITED = "rate_limited"
# A malformed handshake answer is refused exactly like a wrong signature: a prober learns
# nothing from the difference.
MALFORMED_AUTH = "the signature does not verify with the node's key"


class AgentControlConsumer(AsyncWebsocketConsumer):
    node_pk: int | None = None
    node_id: str | None = None
    connected_at = None
    nonce: bytes = b""
    closing = False  # a refusal closed the channel: frames already queued behind it are dropped

    async def connect(self) -> None:
        self.bucket = TokenBucket(settings.SWARM_CONTROL_RATE_PER_S, settings.SWARM_CONTROL_BURST)
        self.refused_in_a_row = 0
        await self.accept()
        self.nonce = secrets.token_bytes(protocol.NONCE_BYTES)
        await self._send(protocol.Nonce(nonce=self.nonce))

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        """Only JSON text frames: anything else closes the channel with a protocol error."""
        if self.closing:
            return
        if not self.bucket.take(time.monotonic()):
            await self._rate_limited()
            return
        self.refused_in_a_row = 0
        if text_data is None:
            await self._refuse("the control channel speaks JSON text frames", CLOSE_PROTOCOL)
            return
        try:
            message = protocol.decode(text_data)
        except ProtocolError as exc:
            await self._malformed(exc)
            return
        if self.node_pk is None:
            if not isinstance(message, protocol.Auth):
                await self._refuse("authenticate first", CLOSE_UNAUTHORIZED)
                return
            await self._authenticate(message)
            return
        try:
            await self._handle(message)
        except NodeError as exc:
            await self._send(protocol.error(exc.code, str(exc)))

    async def _rate_limited(self) -> None:
        self.refused_in_a_row += 1
        rate = settings.SWARM_CONTROL_RATE_PER_S
        if self.refused_in_a_row > settings.SWARM_CONTROL_MAX_REFUSED:
            await self._refuse(f"over {rate:g} messages per second for too long", CLOSE_RATE_LIMITED)
        else:
            await self._send(protocol.error(RATE_LIMITED, f"over {rate:g} messages per second: message not read"))

    async def _malformed(self, exc: ProtocolError) -> None:
        if exc.code in FRAMING_CODES:
            await self._refuse(str(exc), CLOSE_PROTOCOL)
        elif self.node_pk is not None:
            await self._send(protocol.error(exc.code, str(exc)))
        elif exc.kind == MessageType.AUTH:
            self.nonce = b""  # single use, even when the answer is malformed
            await self._refuse(f"{MALFORMED_AUTH} ({InvalidHandshake.code})", CLOSE_UNAUTHORIZED)
        else:
            await self._refuse("authenticate first", CLOSE_UNAUTHORIZED)

    async def _authenticate(self, auth: protocol.Auth) -> None:
        nonce, self.nonce = self.nonce, b""  # single use, even when the answer is wrong
        try:
            node = await database_sync_to_async(joining.authenticate)(
                node_id=auth.node, nonce=nonce, signature=auth.signature
            )
        except NodeError as exc:
            await self._refuse(f"{exc} ({exc.code})", CLOSE_UNAUTHORIZED)
            return
        self.node_pk, self.node_id = node.pk, node.node_id
        await self.channel_layer.group_add(services.node_group(node.node_id), self.channel_name)
        node = await database_sync_to_async(lifecycle.node_connected)(node.pk)
        self.connected_at = node.connected_since
        assignments = await database_sync_to_async(lambda: [a.as_message() for a in assignments_of_node(node.pk)])()
        welcome = protocol.Welcome(
            node=node.node_id,
            state=node.state,
            heartbeat_interval_s=settings.SWARM_HEARTBEAT_INTERVAL_S,
            ticket_key=await database_sync_to_async(ticket_public_key)(),
            assignments=assignments,
            seen_address=self._seen_from(),
        )
        await self._send(welcome)
        log.info("node %s connected", node.node_id)

    async def _handle(self, message: protocol.Message) -> None:
        match message:
            case protocol.Heartbeat():
                await database_sync_to_async(lifecycle.record_heartbeat)(
                    self.node_pk, protocol.to_wire(message)["load"]
                )
            case protocol.Ready(assignment=assignment, url=url):
                await self._ready(assignment, url)
            case protocol.Failed(assignment=assignment, error=error):
                await database_sync_to_async(readiness.assignment_failed)(self.node_pk, assignment, error)
            case protocol.ProbeResult():
                results = protocol.to_wire(message)["results"]
                await database_sync_to_async(claims.record_probe_results)(self.node_pk, results)
            case _:
                # A message of this protocol that only the control plane sends.
                await self._send(protocol.error(protocol.UNKNOWN_TYPE, f"unknown type {str(message.TYPE)!r}"))

    async def _ready(self, assignment: int, url: str) -> None:
        """A block reported served at ``url``: checked as a URL the control plane may route to, then
        opened from here (``reachability.reach``) before it enters placement. An unreachable one
        waits for the agent to report it again through a relay, or fails when there is none."""
        try:
            url = await database_sync_to_async(readiness.checked_data_url)(
                self.node_pk, assignment, url, seen_from=self._seen_from()
            )
        except InvalidDataUrl as exc:  # the assignment was failed with the reason
            log.warning("node %s reported a data URL refused: %s", self.node_id, exc)
            await self._send(protocol.error(exc.code, str(exc)))
            return
        problem = await reachability.reach(url, self.node_id or "") if settings.SWARM_REACHABILITY_CHECK else None
        offer = await database_sync_to_async(services.record_reachability)(self.node_pk, url, problem)
        if problem is None:
            await database_sync_to_async(readiness.assignment_ready)(self.node_pk, assignment, url)
        elif offer is not None:
            await self._send(offer)
        else:
            reason = f"{problem}; no relay is configured (SWARM_RELAYS) to serve it through"
            await database_sync_to_async(readiness.assignment_failed)(
                self.node_pk, assignment, f"unreachable: {reason}"
            )
            await self._send(protocol.error("unreachable", reason))

    def _seen_from(self) -> str | None:
        """The address this channel came from (ASGI ``client``), which an agent's data URL must name."""
        client = self.scope.get("client")
        return str(client[0]) if client else None

    async def control_push(self, event: dict) -> None:
        """A message from the control plane to this agent (group_send from services): the wire
        object of a protocol message, checked again so nothing malformed leaves. A release names the
        jobs still open on the block, read as it leaves: the release committed before it was sent
        and no route takes the block since (``placement.selectors.hold_routes``), so the list is
        whole. An assignment that supersedes a block the agent holds names that block's, likewise."""
        try:
            message = protocol.from_wire(event["message"])
        except ProtocolError:
            log.exception("not pushing a malformed control message to %s", self.node_id)
            return
        if isinstance(message, protocol.Release | protocol.Assign) and self.node_id is not None:
            message = await database_sync_to_async(_with_open_jobs)(self.node_id, message)
        await self._send(message)

    async def disconnect(self, code: int) -> None:
        if self.node_pk is not None and self.node_id is not None:
            await self.channel_layer.group_discard(services.node_group(self.node_id), self.channel_name)
            await database_sync_to_async(services.node_disconnected)(self.node_pk, self.connected_at)
            log.info("node %s disconnected (%s)", self.node_id, code)

    async def _send(self, message: protocol.Message) -> None:
        if self.closing:
            return
        await self.send(text_data=protocol.encode(message))

    async def _refuse(self, message: str, code: int) -> None:
        log.warning("control channel refused: %s", message)
        kind = "unauthorized" if code == CLOSE_UNAUTHORIZED else "protocol"
        await self._send(protocol.error(kind, message))
        self.closing = True
        await self.close(code=code)


def _with_open_jobs(node: str, message: protocol.Release | protocol.Assign) -> protocol.Message:
    """``message`` naming the jobs still open on the block it lets go: a release's own block, or the
    block an assignment supersedes (which the agent's layer cap may drain to make room for it)."""
    if isinstance(message, protocol.Release):
        return dataclasses.replace(message, jobs=_open_jobs_on_block(node, message.assignment))
    superseded = Assignment.objects.filter(pk=message.assignment).values_list("supersedes_id", flat=True).first()
    if superseded is None:
        return message
    return dataclasses.replace(message, supersedes=superseded, jobs=_open_jobs_on_block(node, superseded))


def _open_jobs_on_block(node: str, assignment_pk: int) -> tuple[str, ...]:
    """The jobs still open on ``node``'s block of that assignment (none once it is gone)."""
    assignment = Assignment.objects.filter(pk=assignment_pk).only("model", "layer_start", "layer_end").first()
    if assignment is None:
        return ()
    return open_jobs_on(node, assignment.span, limit=protocol.MAX_ITEMS)


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second; each message takes one."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.at: float | None = None

    def take(self, now: float) -> bool:
        if self.at is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def ticket_public_key() -> str:
    return issuer_public_key().hex()
