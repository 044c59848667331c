"""Serving through a relay: what an agent does once the control plane could not reach it.

The control plane opens the data URL each block is reported at; when nothing answers (a home
router's NAT, a firewall that lets only outbound connections through) it says why and offers its
relays (``control_protocol.UseRelay``) with a pass it signed for this node. ``RelayKeeper`` then:

1. measures the TCP connect time to each offered relay and tries them nearest first;
2. keeps one outbound connection to a relay (``relay_client.RelayClient``), which splices every
   peer that connects to the relay for this node onto the agent's own data port, TLS untouched;
3. reports the URL peers now reach it at (``on_url``), so the agent reports its blocks again there;
4. when that relay goes away, reports ``None`` at once, leaves it out for ``BAD_RELAY_S`` and
   moves to the next; with every relay down it waits (full-jitter backoff) and tries them all again.

A relay dying under a job is a stage failure the job's coordinator heals like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

from worker_agent.agent.joining import backoff_delay
from worker_agent.agent.relay_client import RelayClient
from worker_agent.errors import RelayLost
from worker_agent.protocol import control_protocol as protocol

log = logging.getLogger("swarm.agent")

CONNECT_PROBE_S = 3.0  # one relay's TCP connect, when measuring which is nearest
REGISTER_TIMEOUT_S = 15.0  # from connecting to a relay to its answer naming this node's URL
BAD_RELAY_S = 60.0  # a relay that failed is tried again only after this long, unless none is left
MAX_BACKOFF_S = 30.0


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def connect_time(address: str) -> float:
    """Seconds to open a TCP connection to ``address`` (host:port); ``inf`` when it cannot be opened."""
    host, port = split_address(address)
    started = time.monotonic()
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_PROBE_S)
    except (OSError, TimeoutError):
        return float("inf")
    elapsed = time.monotonic() - started
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return elapsed


class RelayKeeper:
    """Keeps this agent served through one of the offered relays until ``stop``."""

    def __init__(
        self,
        offer: protocol.UseRelay,
        *,
        signing_key,
        local_address: tuple[str, int],
        tls: bool,
        on_url: Callable[[str | None], None],
        rng: random.Random | None = None,
    ) -> None:
        self.offer = offer
        self.signing_key = signing_key
        self.local_address = local_address
        self.tls = tls
        self.on_url = on_url
        self.rng = rng or random.Random()
        self.url: str | None = None  # where peers reach this agent now; None between relays
        self.relay: str | None = None  # the id of the relay serving it
        self._failed_at: dict[str, float] = {}  # relay id -> when it last failed

    def renew(self, offer: protocol.UseRelay) -> None:
        """A newer offer (a fresh pass, other relays): used from the next connection on."""
        self.offer = offer

    async def run(self) -> None:
        attempt = 0
        while True:
            for relay in await self._candidates():
                if await self._serve(relay):
                    attempt = 0
            delay = backoff_delay(attempt, self.rng, cap_s=MAX_BACKOFF_S)
            log.warning("no relay could serve this agent; trying them again in %.1fs", delay)
            await asyncio.sleep(delay)
            attempt += 1

    async def _candidates(self) -> list[protocol.RelayOffer]:
        """The offered relays that answer, nearest first; those that failed lately go last."""
        offers = self.offer.relays
        times = await asyncio.gather(*(connect_time(relay.address) for relay in offers))
        ranked = sorted(
            (self._failed_lately(offer.id), took, index)
            for index, (offer, took) in enumerate(zip(offers, times, strict=True))
            if took != float("inf")
        )
        for failed, took, index in ranked:
            log.info(
                "relay %s at %s: connects in %.1f ms%s",
                offers[index].id,
                offers[index].address,
                took * 1000,
                " (failed lately)" if failed else "",
            )
        return [offers[index] for _, _, index in ranked]

    def _failed_lately(self, relay_id: str) -> bool:
        failed_at = self._failed_at.get(relay_id)
        return failed_at is not None and time.monotonic() - failed_at < BAD_RELAY_S

    async def _serve(self, relay: protocol.RelayOffer) -> bool:
        """Serve through ``relay`` until it goes away; whether it ever served this agent."""
        client = RelayClient(
            split_address(relay.address),
            bytes.fromhex(self.offer.relay_pass),
            self.signing_key,
            self.local_address,
        )
        running = asyncio.create_task(client.run())
        waiting = asyncio.create_task(client.registered.wait())
        served = False
        try:
            await asyncio.wait({running, waiting}, timeout=REGISTER_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            if not client.registered.is_set():
                log.warning("relay %s did not register this agent within %gs", relay.id, REGISTER_TIMEOUT_S)
            elif not running.done():
                served = True
                self.url, self.relay = client.public_url(tls=self.tls), relay.id
                log.info("serving through relay %s: peers reach this agent at %s", relay.id, self.url)
                self.on_url(self.url)
            await running  # until the relay goes away (RelayLost)
        except RelayLost as exc:
            log.warning("relay %s: %s (%s)", relay.id, exc, exc.code)
        finally:
            for task in (waiting, running):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RelayLost):
                await running
            self._failed_at[relay.id] = time.monotonic()
            if served:
                self.url = self.relay = None
                self.on_url(None)
        return served
