"""The control plane's job-ticket issuer key (ed25519). Agents trust its public half, which they
pin when they join (the join call's answer) and find again in the control channel's welcome;
per-job tickets are signed with it, each naming the job's coordinator key and expiring with the
job's deadline."""

from __future__ import annotations

import fcntl
import time
from functools import cache

from django.conf import settings
from nacl.signing import SigningKey

from worker_agent.protocol.keys import generate_signing_key, load_signing_key, public_key_bytes, write_key
from worker_agent.protocol.span import Span
from worker_agent.protocol.tickets import issue_ticket

# A ticket outlives its job's deadline by this much: room for clock skew between the control plane
# and the agents, and for the sessions' CLOSE once the job is stopped.
TICKET_MARGIN_S = 30.0


def job_ticket_expiry() -> float:
    """When the tickets of a job starting now expire (unix seconds): the job's timeout, plus the margin.
    Every job's tickets, a challenge's included, expire so: a node cannot tell them apart by it."""
    return time.time() + settings.SWARM_JOB_TIMEOUT_S + TICKET_MARGIN_S


@cache
def issuer_key() -> SigningKey:
    path = settings.SWARM_TICKET_KEY_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".ticket.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several web processes may start at once
        if not path.exists():
            write_key(path, generate_signing_key())
    return load_signing_key(path)


def issuer_public_key() -> bytes:
    return public_key_bytes(issuer_key())


def ticket_for(
    *,
    job: str,
    node: str,
    span: Span,
    coordinator_key: bytes,
    expires_at: float,
) -> bytes:
    """A ticket for ``node`` to serve ``span`` of ``job`` to the coordinator holding
    ``coordinator_key`` (its public half), until ``expires_at`` (unix seconds: the job's deadline)."""
    return issue_ticket(
        issuer_key(),
        job=job,
        node=node,
        model=span.model,
        layer_start=span.start,
        layer_end=span.end,
        coordinator_key=coordinator_key,
        expires_at=expires_at,
    )
