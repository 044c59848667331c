"""A placed block's agent reports: loaded and served at a data URL (ready), or failed to load.

A ready block is routable (``selectors.servable_pipelines``) once the data URL it names is one the
control plane may route to for its node (``checked_data_url``); the block it superseded on that node
is let go at the agent then, and once every live block of the model is ready the placed nodes
measure their links (``request_probes``). A failed block is let go too, and its model placed again.
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node
from marketplace.nodes.reachability import relay_at, relay_of
from marketplace.nodes.services import push
from marketplace.placement.blocks import joined_id, release_superseded
from marketplace.placement.data_urls import check_data_url
from marketplace.placement.errors import InvalidDataUrl
from marketplace.placement.models import LIVE_STATES, Assignment, AssignmentState
from marketplace.placement.rebalancing import mark_dirty, release_leaving
from marketplace.placement.selectors import hold_routes, region_target
from worker_agent.protocol import control_protocol as protocol

log = logging.getLogger("swarm.placement")


@transaction.atomic
def assignment_ready(node_pk: int, assignment_pk: int, data_url: str) -> bool:
    """The agent reports its block loaded and served at ``data_url``; False if it is stale.
    The block it superseded on that node is released at the agent now. Once every live block of
    the model is up, the placed nodes measure their links."""
    model = Assignment.objects.filter(pk=assignment_pk).values_list("model", flat=True).first()
    if model is None:
        return False
    # It may let go blocks of nodes leaving the model (``release_leaving``): taken before this
    # assignment's row, in the order every release takes them.
    hold_routes(model)
    # A block confirmed again after its node reconnected (``lifecycle.node_connected``) was ready before:
    # the links around it were measured then, and are not probed again for it.
    confirmed_again = Assignment.objects.filter(pk=assignment_pk, ready_at__isnull=False).exists()
    moved = (
        Assignment.objects.filter(pk=assignment_pk, node_id=node_pk, state=AssignmentState.READY)
        .exclude(data_url=data_url[:255])
        .update(data_url=data_url[:255])
    )
    if moved:
        # Served from another address now (through another relay, say): the links are measured again.
        notify_node_changed(node_pk)
        live = Assignment.objects.filter(model=model, state__in=LIVE_STATES).select_related("node")
        request_probes(model, [a.node for a in live])
        return True
    updated = Assignment.objects.filter(pk=assignment_pk, node_id=node_pk, state=AssignmentState.ASSIGNED).update(
        state=AssignmentState.READY, ready_at=timezone.now(), data_url=data_url[:255]
    )
    if updated:
        release_superseded(assignment_pk)
        notify_node_changed(node_pk)
        release_leaving(model)  # this block may be the last one the model waited for
        live = Assignment.objects.filter(model=model, state__in=LIVE_STATES).select_related("node")
        if not confirmed_again and all(a.state == AssignmentState.READY for a in live):
            request_probes(model, [a.node for a in live])
    return bool(updated)


def report_ready(node_pk: int, assignment_pk: int, data_url: str, *, seen_from: str | None) -> bool:
    """The agent's own report that its block is served at ``data_url``, from a control channel
    that came from ``seen_from`` (an IP address; None when unknown), taken as it comes: as
    ``checked_data_url``, then ``assignment_ready``. The control channel checks that the URL can be
    reached in between (``nodes.reachability``)."""
    return assignment_ready(
        node_pk, assignment_pk, checked_data_url(node_pk, assignment_pk, data_url, seen_from=seen_from)
    )


def checked_data_url(node_pk: int, assignment_pk: int, data_url: str, *, seen_from: str | None) -> str:
    """``data_url`` if the control plane may route to it for this node: its own address
    (``data_urls.check_data_url``) or its URL at a configured relay. Otherwise the assignment fails
    with the reason and ``InvalidDataUrl`` is raised: no connection is ever opened to an address an
    agent merely names."""
    try:
        node_id = Node.objects.values_list("node_id", flat=True).get(pk=node_pk) or ""
        if relay_of(data_url, node_id) is None:
            if (relay := relay_at(data_url)) is not None:  # another node's URL there, or no node's
                raise InvalidDataUrl(
                    f"data URL {data_url!r} is at relay {relay.id} but is not this node's URL there "
                    f"({relay.url(node_id, tls=True)} or {relay.url(node_id, tls=False)})",
                    param="url",
                )
            check_data_url(data_url, seen_from=seen_from, allowed_hosts=settings.SWARM_AGENT_URL_HOSTS)
        _check_tls(node_pk, data_url)
    except InvalidDataUrl as exc:
        assignment_failed(node_pk, assignment_pk, f"{exc.code}: {exc}")
        raise
    return data_url


def _check_tls(node_pk: int, url: str) -> None:
    """A node certified for TLS at join, or any node where the settings require TLS, serves wss://:
    no agent takes its jobs' traffic back to plain text."""
    if url.startswith("wss://"):
        return
    if Node.objects.filter(pk=node_pk).exclude(tls_certificate="").exists():
        raise InvalidDataUrl(f"data URL {url!r} must use wss://: this node joined with a TLS certificate", param="url")
    if settings.SWARM_REQUIRE_DATA_TLS:
        raise InvalidDataUrl(
            f"data URL {url!r} must use wss://: this control plane requires TLS on the data plane "
            "(join again with swarm-worker join --tls auto)",
            param="url",
        )


@transaction.atomic
def assignment_failed(node_pk: int, assignment_pk: int, error: str) -> bool:
    updated = Assignment.objects.filter(pk=assignment_pk, node_id=node_pk, state=AssignmentState.ASSIGNED).update(
        state=AssignmentState.FAILED, error=error[:2000], released_at=timezone.now()
    )
    if updated:
        release_superseded(assignment_pk)  # nothing to wait for: the old block goes too
        notify_node_changed(node_pk)
        mark_dirty(Assignment.objects.get(pk=assignment_pk).model)
    return bool(updated)


def request_probes(model: str, nodes: list[Node]) -> None:
    """Ask each placed node to measure its links to the others and to the coordinator regions."""
    for node in nodes:
        targets = [
            protocol.ProbeTarget(target=joined_id(other), url=other.data_url)
            for other in nodes
            if other.pk != node.pk and other.data_url
        ]
        targets += [
            protocol.ProbeTarget(target=region_target(r), url=settings.SWARM_REGION_PROBE_URLS.get(r))
            for r in settings.SWARM_COORDINATOR_REGIONS
        ]
        push(joined_id(node), protocol.to_wire(protocol.Probe(model=model, targets=tuple(targets))))
    log.info("asked %d nodes to probe their links for %s", len(nodes), model)
