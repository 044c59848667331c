"""The agent control channel (Channels WebSocket, JSON messages).

Handshake: the server sends a fresh random nonce; the agent answers with its node id and an
ed25519 signature over ``swarm-control-v1\\0 || nonce || node id``. A forged signature, an unknown
node or a replayed answer (signed over another connection's nonce) closes the channel with code
4401. Then: heartbeats (with load) from the agent; assignments, drain, stop, probe and challenge
requests from the control plane; ready / failed / probe and challenge results from the agent.
"""

from __future__ import annotations

import logging
import secrets

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from marketplace.nodes import services
from marketplace.nodes.errors import NodeError
from marketplace.nodes.tickets import issuer_public_key
from marketplace.placement import services as placement
from marketplace.placement.selectors import assignments_of_node
from marketplace.verification import services as verification
from marketplace.verification.errors import VerificationError

log = logging.getLogger("swarm.control")

CLOSE_UNAUTHORIZED = 4401
CLOSE_PROTOCOL = 4400


class AgentControlConsumer(AsyncJsonWebsocketConsumer):
    node_pk: int | None = None
    node_id: str | None = None
    connected_at = None
    nonce: bytes = b""

    async def connect(self) -> None:
        await self.accept()
        self.nonce = secrets.token_bytes(32)
        await self.send_json({"type": "challenge", "nonce": self.nonce.hex()})

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        """Only JSON text frames: anything else closes the channel with a protocol error."""
        if text_data is None:
            await self._refuse("the control channel speaks JSON text frames", CLOSE_PROTOCOL)
            return
        try:
            content = await self.decode_json(text_data)
        except ValueError:
            await self._refuse("a frame is not valid JSON", CLOSE_PROTOCOL)
            return
        await self.receive_json(content, **kwargs)

    async def receive_json(self, content, **kwargs) -> None:
        if not isinstance(content, dict) or not isinstance(content.get("type"), str):
            await self._refuse("messages are JSON objects with a type", CLOSE_PROTOCOL)
            return
        kind = content["type"]
        if self.node_pk is None:
            if kind != "auth":
                await self._refuse("authenticate first", CLOSE_UNAUTHORIZED)
                return
            await self._authenticate(content)
            return
        try:
            await self._handle(kind, content)
        except NodeError as exc:
            await self.send_json({"type": "error", "code": exc.code, "message": str(exc)})

    async def _authenticate(self, content: dict) -> None:
        nonce, self.nonce = self.nonce, b""  # single use, even when the answer is wrong
        try:
            node = await database_sync_to_async(services.authenticate)(
                node_id=content.get("node"), nonce=nonce, signature=str(content.get("signature", ""))
            )
        except NodeError as exc:
            await self._refuse(f"{exc} ({exc.code})", CLOSE_UNAUTHORIZED)
            return
        self.node_pk, self.node_id = node.pk, node.node_id
        await self.channel_layer.group_add(services.node_group(node.node_id), self.channel_name)
        node = await database_sync_to_async(placement.node_connected)(node.pk)
        self.connected_at = node.connected_since
        assignments = await database_sync_to_async(lambda: [a.as_message() for a in assignments_of_node(node.pk)])()
        await self.send_json(
            {
                "type": "welcome",
                "node": node.node_id,
                "state": node.state,
                "heartbeat_interval_s": settings.SWARM_HEARTBEAT_INTERVAL_S,
                "ticket_key": await database_sync_to_async(ticket_public_key)(),
                "assignments": assignments,
            }
        )
        log.info("node %s connected", node.node_id)

    async def _handle(self, kind: str, content: dict) -> None:
        match kind:
            case "heartbeat":
                await database_sync_to_async(placement.record_heartbeat)(self.node_pk, content.get("load", {}))
            case "ready":
                await database_sync_to_async(placement.assignment_ready)(
                    self.node_pk, _int(content.get("assignment")), str(content.get("url", ""))
                )
            case "failed":
                await database_sync_to_async(placement.assignment_failed)(
                    self.node_pk, _int(content.get("assignment")), str(content.get("error", ""))
                )
            case "probe_result":
                await database_sync_to_async(services.record_links)(self.node_pk, content.get("results"))
            case "challenge_result":
                try:
                    await database_sync_to_async(verification.record_challenge_answer)(self.node_pk, content)
                except VerificationError as exc:
                    await self.send_json({"type": "error", "code": exc.code, "message": str(exc)})
            case _:
                await self.send_json({"type": "error", "code": "unknown_type", "message": f"unknown type {kind!r}"})

    async def control_push(self, event: dict) -> None:
        """A message from the control plane to this agent (group_send from services)."""
        await self.send_json(event["message"])

    async def disconnect(self, code: int) -> None:
        if self.node_pk is not None:
            await self.channel_layer.group_discard(services.node_group(self.node_id), self.channel_name)
            await database_sync_to_async(services.node_disconnected)(self.node_pk, self.connected_at)
            log.info("node %s disconnected (%s)", self.node_id, code)

    async def _refuse(self, message: str, code: int) -> None:
        log.warning("control channel refused: %s", message)
        await self.send_json(
            {"type": "error", "code": "unauthorized" if code == CLOSE_UNAUTHORIZED else "protocol", "message": message}
        )
        await self.close(code=code)


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def ticket_public_key() -> str:
    return issuer_public_key().hex()
