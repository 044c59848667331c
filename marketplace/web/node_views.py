"""A provider's node pages: the list with the form that adds a node, one node's page (its status,
earnings, reputation and checks) and the fragments that keep them live, and the node's actions
(a new join token, dismissing the join command, drain, remove after a confirmation).

As in ``views``: a page checks the provider's role, validates its input and calls one service;
another provider's node answers 404, as if it did not exist. A node's join command is shown from
the moment it is made until its owner dismisses it (``nodes.shown_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from marketplace.install.script import join_command
from marketplace.nodes import shown_tokens
from marketplace.nodes.errors import NodeError, NodeNameTaken
from marketplace.nodes.models import Node
from marketplace.placement import lifecycle
from marketplace.web import node_selectors, selectors, services, trust_selectors
from marketplace.web.forms import NodeForm
from marketplace.web.views import HtmxRequest, provider_required


@dataclass(frozen=True)
class JoinCommand:
    node: Node
    command: str  # the line the provider pastes on the machine
    used: bool  # its agent joined with it already


def _join_command(request: HttpRequest, node: Node) -> JoinCommand | None:
    """The node's join command while its owner keeps it on screen: the control plane's install
    script, which installs the agent and joins with the token."""
    shown = shown_tokens.shown(node)
    if shown is None:
        return None
    return JoinCommand(node, join_command(request, shown.token), shown.used)


def _own_node(request: HttpRequest, pk: int) -> Node:
    node = selectors.node_of(request.user, pk)
    if node is None:
        raise Http404("no such node")
    return node


# --- the list -------------------------------------------------------------------------------------


def _nodes_panel(request: HtmxRequest, form: NodeForm) -> HttpResponse:
    """The panel (for HTMX, which swaps it in) or the page; a refused form answers 400 on a page load.
    Every join command still on screen is shown again, whatever happened to the form."""
    statuses = selectors.provider_nodes(request.user)
    joins = [join for join in (_join_command(request, status.node) for status in statuses) if join]
    context = {"form": form, "nodes": statuses, "joins": joins}
    status = 400 if form.errors and not request.htmx else 200
    template = "web/partials/nodes_panel.html" if request.htmx else "web/provider_nodes.html"
    return render(request, template, context, status=status)


@provider_required
@require_http_methods(["GET", "POST"])
def nodes(request: HtmxRequest) -> HttpResponse:
    if request.method == "GET":
        return _nodes_panel(request, NodeForm())
    form = NodeForm(request.POST)
    if not form.is_valid():
        return _nodes_panel(request, form)
    try:
        services.add_node(owner=request.user, **form.cleaned_data)
    except NodeNameTaken as exc:
        form.add_error(exc.param, str(exc))
        return _nodes_panel(request, form)
    except NodeError as exc:
        raise PermissionDenied(str(exc)) from exc
    return _nodes_panel(request, NodeForm())


@provider_required
@require_GET
def node_row_fragment(request: HttpRequest, pk: int) -> HttpResponse:
    return render(request, "web/partials/node_row.html", {"status": selectors.node_status(_own_node(request, pk))})


# --- one node -------------------------------------------------------------------------------------


def _earnings(status: selectors.NodeStatus) -> node_selectors.NodeEarnings:
    return node_selectors.node_earnings(status.node, status.agent, status.blocks, status.tokens_served)


def _node_page(request: HttpRequest, node: Node) -> dict:
    status = selectors.node_status(node)
    return {
        "node": node,
        "status": status,
        "earnings": _earnings(status),
        "trust": trust_selectors.node_trust(node),
        "track": status.track,
        "join": _join_command(request, node),
    }


@provider_required
@require_GET
def node_detail(request: HttpRequest, pk: int) -> HttpResponse:
    return render(request, "web/provider_node.html", _node_page(request, _own_node(request, pk)))


@provider_required
@require_GET
def node_status_fragment(request: HttpRequest, pk: int) -> HttpResponse:
    return render(request, "web/partials/node_status.html", {"status": selectors.node_status(_own_node(request, pk))})


@provider_required
@require_GET
def node_earnings_fragment(request: HttpRequest, pk: int) -> HttpResponse:
    status = selectors.node_status(_own_node(request, pk))
    return render(request, "web/partials/node_earnings.html", {"node": status.node, "earnings": _earnings(status)})


@provider_required
@require_GET
def node_trust_fragment(request: HttpRequest, pk: int) -> HttpResponse:
    node = _own_node(request, pk)
    context = {"trust": trust_selectors.node_trust(node), "track": node_selectors.reputation_track(node)}
    return render(request, "web/partials/node_trust.html", context)


# --- actions --------------------------------------------------------------------------------------


@provider_required
@require_POST
def node_rotate_token(request: HtmxRequest, pk: int) -> HttpResponse:
    node = _own_node(request, pk)
    services.new_join_token(node)
    join = _join_command(request, node)
    if request.htmx and join is not None:
        context = {"node": node, "command": join.command, "used": join.used, "back": "node"}
        return render(request, "web/partials/join_command.html", context)
    return redirect("web:node", pk=node.pk)


@provider_required
@require_GET
def node_join_fragment(request: HttpRequest, pk: int) -> HttpResponse:
    """The node's join command box, as it is now (its agent may have joined with it meanwhile); an
    empty placeholder once it is no longer shown."""
    node = _own_node(request, pk)
    join = _join_command(request, node)
    if join is None:
        return HttpResponse(f'<div id="join-box-{node.pk}" hidden></div>')
    back = "node" if request.GET.get("back") == "node" else "nodes"
    context = {"node": node, "command": join.command, "used": join.used, "back": back}
    return render(request, "web/partials/join_command.html", context)


@provider_required
@require_POST
def node_join_dismiss(request: HtmxRequest, pk: int) -> HttpResponse:
    """The provider is done with the join command: it is not shown again (HTMX swaps the box out)."""
    node = _own_node(request, pk)
    services.dismiss_join_command(node)
    if request.htmx:
        return HttpResponse("")
    return redirect("web:node", pk=node.pk) if request.POST.get("back") == "node" else redirect("web:nodes")


@provider_required
@require_POST
def node_drain(request: HtmxRequest, pk: int) -> HttpResponse:
    node = lifecycle.drain_node(_own_node(request, pk))
    if request.htmx:
        return render(request, "web/partials/node_status.html", {"status": selectors.node_status(node)})
    return redirect("web:node", pk=node.pk)


@provider_required
@require_http_methods(["GET", "POST"])
def node_remove(request: HttpRequest, pk: int) -> HttpResponse:
    """GET: what removing the node does, and a button to confirm; POST: remove it."""
    node = _own_node(request, pk)
    if request.method == "GET":
        status = selectors.node_status(node)
        return render(request, "web/provider_node_remove.html", {"node": node, "earnings": _earnings(status)})
    services.remove_node(node)
    messages.success(request, f"{node.name} was removed. What it earned stays on your Earnings page.")
    return redirect("web:nodes")
