"""Which data-plane URL an agent may report for its block (pure: no ORM, no settings).

The control plane routes jobs to the URL an agent reports when its block is ready, so a node must
not be able to point them anywhere else: at another machine (to make its requests hang, or to aim
the coordinators' traffic at a third party), or at a privileged port of its own host. A URL is
accepted only if its scheme is ``ws`` or ``wss``, it carries no credentials, query or fragment,
its port is explicit and in 1024-65535, and its host is the address the agent's control channel
came from, or one of the host names an operator allowed (agents behind a reverse proxy or NAT).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection
from urllib.parse import urlsplit

from marketplace.placement.errors import InvalidDataUrl

MIN_PORT = 1024
MAX_PORT = 65535


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    # An IPv4 agent seen through a dual-stack socket arrives as ::ffff:a.b.c.d.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def check_data_url(url: str, *, seen_from: str | None, allowed_hosts: Collection[str] = ()) -> str:
    """``url`` if an agent whose control channel came from ``seen_from`` (an IP address, or None
    when unknown) may report it; raises ``InvalidDataUrl`` naming what is wrong otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidDataUrl(f"data URL {url!r} is not a valid URL: {exc}", param="url") from None
    if parts.scheme not in ("ws", "wss"):
        raise InvalidDataUrl(f"data URL {url!r} must use ws:// or wss://, not {parts.scheme!r}", param="url")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise InvalidDataUrl(f"data URL {url!r} may carry no credentials, query or fragment", param="url")
    host = (parts.hostname or "").lower()
    if not host:
        raise InvalidDataUrl(f"data URL {url!r} names no host", param="url")
    if port is None or not MIN_PORT <= port <= MAX_PORT:
        raise InvalidDataUrl(f"data URL {url!r} must name a port in {MIN_PORT}-{MAX_PORT}, not {port}", param="url")
    if host in {allowed.lower() for allowed in allowed_hosts}:
        return url
    address = _address(host)
    seen = _address(seen_from) if seen_from else None
    if address is None or seen is None or address != seen:
        raise InvalidDataUrl(
            f"data URL {url!r} must point at the address this agent connects from "
            f"({seen_from or 'unknown'}) or a host allowed by SWARM_AGENT_URL_HOSTS",
            param="url",
        )
    return url
