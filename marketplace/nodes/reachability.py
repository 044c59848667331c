"""Whether the control plane can reach an agent's data plane, and the relays it offers when not.

An agent reports a block ready at a data URL; nothing it says about its own reachability is
believed. Before the block enters placement the control plane opens that URL itself (``reach``):
a WebSocket handshake within ``SWARM_REACHABILITY_TIMEOUT_S``, over TLS pinned to the swarm's CA
and the node's name when the URL is ``wss://`` (the coordinator's own client certificate, as a
job's coordinator would connect). What it finds is recorded on the node (``models.Reachability``) and
shown on its page:

- ``direct``: the URL answered; coordinators and ring predecessors connect to it;
- ``relayed``: the URL is a relay's (``SWARM_RELAYS``) and answered through the relay;
- ``unreachable``: it did not answer (a home router's NAT, a firewall, a wrong address). The
  agent is told why and offered the configured relays with a pass signed by the ticket key
  (``relay_offer``); it connects out to the nearest and reports its block again at the relay's
  URL, which is checked the same way. Without relays the block fails with the reason.

A relay's URL for a node is ``wss://HOST:PORT`` (the relay routes by the TLS server name,
``<node>.swarm``, and forwards the ciphertext) or ``ws://HOST:PORT/relay/<node>`` for an agent
without TLS; ``relay_of`` recognises both, and only for the node they name.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import websockets
from django.conf import settings
from websockets.asyncio.client import connect

from marketplace.nodes.authority import coordinator_tls, held_coordinator_tls
from marketplace.nodes.tickets import issuer_key
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol.relay_pass import sign_relay_pass
from worker_agent.protocol.tls import connect_options


@dataclass(frozen=True)
class Relay:
    id: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def url(self, node: str, *, tls: bool) -> str:
        """The data URL a node served through this relay has."""
        return f"wss://{self.address}" if tls else f"ws://{self.address}/relay/{node}"


def relays() -> list[Relay]:
    """The configured relays (``SWARM_RELAYS``, checked by the settings)."""
    configured = []
    for entry in settings.SWARM_RELAYS:
        relay_id, _, address = entry.partition("=")
        host, _, port = address.rpartition(":")
        configured.append(Relay(relay_id, host.lower(), int(port)))
    return configured


def relay_of(url: str, node: str) -> Relay | None:
    """The configured relay ``url`` is this node's URL at, if it is one."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    for relay in relays():
        if (parts.hostname or "").lower() != relay.host or port != relay.port:
            continue
        if url in (relay.url(node, tls=True), relay.url(node, tls=False)):
            return relay
    return None


def relay_at(url: str) -> Relay | None:
    """The configured relay whose address ``url`` names, whatever its path."""
    try:
        parts = urlsplit(url)
        address = f"{(parts.hostname or '').lower()}:{parts.port}"
    except ValueError:
        return None
    return next((relay for relay in relays() if relay.address == address), None)


def relay_offer(node: str, public_key_hex: str, reason: str) -> protocol.UseRelay | None:
    """The relays an unreachable node may serve through, with a pass for any of them; None when
    none is configured."""
    configured = relays()
    if not configured:
        return None
    relay_pass = sign_relay_pass(
        issuer_key(),
        node=node,
        node_public_key=bytes.fromhex(public_key_hex),
        relay="*",
        expires_at=time.time() + settings.SWARM_RELAY_PASS_TTL_S,
    )
    offers = tuple(protocol.RelayOffer(id=relay.id, address=relay.address) for relay in configured)
    return protocol.UseRelay(reason=reason[:2000], relay_pass=relay_pass.hex(), relays=offers[: protocol.MAX_RELAYS])


async def reach(url: str, node: str) -> str | None:
    """None if a WebSocket handshake with ``url`` succeeds within the timeout, as the stage of
    ``node`` (its certificate must name it for ``wss://``); otherwise why not, in words."""
    options = {}
    if url.lower().startswith("wss://"):
        context = held_coordinator_tls() or await asyncio.to_thread(coordinator_tls)
        options = connect_options(url, node, context)
    timeout = settings.SWARM_REACHABILITY_TIMEOUT_S
    try:
        async with asyncio.timeout(timeout):
            async with connect(url, open_timeout=timeout, close_timeout=1, compression=None, **options):
                return None
    except TimeoutError:
        return f"no answer from {url} within {timeout:g} s (a firewall or a NAT router drops the connection)"
    except ConnectionRefusedError:
        return f"{url} refused the connection (nothing listens there, or a NAT router answers for it)"
    except OSError as exc:
        return f"cannot connect to {url}: {exc.strerror or exc}"
    except websockets.InvalidHandshake as exc:
        return f"{url} answered, but not as an agent's data plane: {exc}"
    except websockets.WebSocketException as exc:
        return f"{url} failed the WebSocket handshake: {exc}"


async def relay_down(url: str, timeout: float) -> Relay | None:
    """The configured relay ``url`` is at, when a TCP connection to it is refused or not answered
    within ``timeout`` (its process or host is gone); None when ``url`` is no relay's or it answers.
    A relay that accepts connections but lost one agent says nothing against the others."""
    relay = relay_at(url)
    if relay is None:
        return None
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(relay.host, relay.port), timeout)
    except (OSError, TimeoutError):
        return relay
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None
