"""Link measurements an agent makes when the control plane asks (``probe``): the round trip and
uplink to each peer's data plane, the round trip to each coordinator region. Only the targets the
control plane sent are measured, each within its time bound, at URLs that target can have, and a
probed peer may answer with little: a hostile one cannot make the prober read megabytes."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import urllib.parse
import urllib.request

import websockets
from websockets.asyncio.client import connect

from worker_agent.errors import SwarmError
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol import wire
from worker_agent.protocol.tls import connect_options

log = logging.getLogger("swarm.agent")

PROBE_MAX_REPLY = 64 * 1024  # bytes a probed peer may answer with (an ERROR or PONG is far smaller)
PROBE_TIMEOUT_S = 10.0  # one target's whole measurement
PROBE_BUDGET_S = 60.0  # all the targets of one probe request
MAX_PROBE_TARGETS = 64  # targets measured per probe request; the rest are left out


async def measure(
    targets: tuple[protocol.ProbeTarget, ...], control_plane: str, *, tls: ssl.SSLContext | None = None
) -> tuple[protocol.LinkResult, ...]:
    """RTT and uplink to each peer's data plane; RTT to each coordinator region's probe URL (a
    region without a URL is the control plane's own), within PROBE_BUDGET_S in all. With the
    swarm's client context ``tls`` a wss:// peer is reached as a ring predecessor reaches it: its
    certificate must name the node it is probed as."""
    results = []
    deadline = time.monotonic() + PROBE_BUDGET_S
    for target in targets[:MAX_PROBE_TARGETS]:
        url = probe_url(target, control_plane)
        if url is None:
            log.warning("not probing %s: %r is not a URL that target can have", target.target, target.url)
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("probe budget of %gs spent; %s and later targets left out", PROBE_BUDGET_S, target.target)
            break
        timeout = min(PROBE_TIMEOUT_S, left)
        try:
            if url.startswith("ws"):
                options = connect_options(url, target.target, tls)
                measured = await asyncio.wait_for(probe_link(url, timeout, **options), timeout)
            else:
                measured = await asyncio.wait_for(asyncio.to_thread(probe_http, url, timeout), timeout)
        except (OSError, websockets.WebSocketException, TimeoutError, SwarmError, ValueError) as exc:
            log.warning("cannot probe %s at %s: %s", target.target, url, exc)
            continue
        results.append(protocol.LinkResult(target=target.target[:64], **measured))
    log.debug("probed %d of %d targets", len(results), len(targets))
    return tuple(results)


def probe_url(target: protocol.ProbeTarget, control_plane: str) -> str | None:
    """The URL to measure ``target`` at, or None when it is not one that target can have: a
    peer node is measured only at a data-plane ``ws://``/``wss://`` URL (host and port), a
    coordinator region (``region:<name>``) at an ``http(s)://`` URL, or the control plane's own
    ``/healthz`` when it names none. Only targets the control plane sent are ever probed."""
    url = target.url
    if target.target.startswith("region:"):
        schemes: tuple[str, ...] = ("http", "https")
        if url is None:
            return f"{control_plane.rstrip('/')}/healthz"
    else:
        schemes = ("ws", "wss")
    if url is None:
        return None
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in schemes or not parts.hostname or parts.username or parts.password:
        return None
    if parts.scheme in ("ws", "wss") and port is None:
        return None
    return url


def probe_http(url: str, timeout: float = 10.0, tries: int = 3) -> dict:
    """Best-of-``tries`` round trip of a small HTTP GET (connection set-up excluded as far as
    urllib allows: the first try warms DNS and routes)."""
    best = float("inf")
    for _ in range(tries):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=timeout) as response:
            response.read(PROBE_MAX_REPLY)
        best = min(best, time.perf_counter() - started)
    return {"rtt_ms": round(best * 1000, 3)}


async def probe_link(url: str, timeout: float = 10.0, **tls) -> dict:
    """RTT and uplink to a data-plane URL (``tls``: ``connect_options``). A reply over
    PROBE_MAX_REPLY bytes closes the connection (the probe fails) before it is read whole."""
    async with connect(url, open_timeout=timeout, compression=None, max_size=PROBE_MAX_REPLY, **tls) as ws:
        started = time.perf_counter()
        await ws.send(wire.encode(wire.Ping(nonce=1), seq=1))
        await _pong(ws, 1, timeout)
        rtt = time.perf_counter() - started
        # A PING padded with MAX_PING_PAD zero bytes is answered once fully received, so the time
        # to its PONG is one RTT plus pushing the bytes through the uplink.
        blob = wire.encode(wire.Ping(nonce=2, pad=wire.MAX_PING_PAD), seq=2)
        started = time.perf_counter()
        await ws.send(blob)
        await _pong(ws, 2, timeout)
        push = max(time.perf_counter() - started - rtt, 1e-6)
    return {"rtt_ms": round(rtt * 1000, 3), "uplink_mbps": round(len(blob) * 8 / push / 1e6, 1)}


async def _pong(ws, nonce: int, timeout: float) -> None:
    """Wait for the PONG to PING ``nonce``; any other answer fails the probe."""
    reply = wire.decode(await asyncio.wait_for(ws.recv(), timeout), max_frame=PROBE_MAX_REPLY).message
    if isinstance(reply, wire.Error):
        raise SwarmError(f"the peer refused the probe: {reply.code}: {reply.message}", code="probe_refused")
    if not isinstance(reply, wire.Pong) or reply.nonce != nonce:
        raise SwarmError(f"the peer answered the probe's PING {nonce} with {reply}", code="probe_refused")
