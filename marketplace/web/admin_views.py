"""The admins' dashboard pages: swarm health, the strike queue, payout batches, node ejection.
Staff only; every action calls one service and shows what it refused."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from marketplace.nodes import services as node_services
from marketplace.nodes.errors import NodeError
from marketplace.nodes.models import Node, NodeState
from marketplace.payouts import services as payout_services
from marketplace.payouts.errors import PayoutRefused
from marketplace.payouts.models import PayoutState
from marketplace.placement import lifecycle
from marketplace.verification import strikes as strike_services
from marketplace.verification.errors import StrikeDecisionRefused
from marketplace.verification.models import StrikeState
from marketplace.web import selectors, trust_selectors
from marketplace.web.forms import EjectForm, StrikeDecisionForm
from marketplace.web.views import HtmxRequest, staff_required


def _swarm_context() -> dict:
    counts, nodes = selectors.all_nodes()
    return {"health": selectors.swarm_health(), "state_counts": counts, "nodes": nodes}


def _swarm_page_context() -> dict:
    return _swarm_context() | {"heatmap": selectors.latency_heatmap(), "throughput": selectors.throughput()}


@staff_required
@require_GET
def swarm(request: HttpRequest) -> HttpResponse:
    return render(request, "web/admin_swarm.html", _swarm_page_context())


@staff_required
@require_GET
def swarm_health_fragment(request: HttpRequest) -> HttpResponse:
    return render(request, "web/partials/swarm_health.html", _swarm_context())


@staff_required
@require_GET
def latency_fragment(request: HttpRequest) -> HttpResponse:
    return render(request, "web/partials/latency.html", {"heatmap": selectors.latency_heatmap()})


@staff_required
@require_GET
def throughput_fragment(request: HttpRequest) -> HttpResponse:
    return render(request, "web/partials/throughput.html", {"throughput": selectors.throughput()})


def _strike_lists(form: StrikeDecisionForm | None = None) -> dict:
    """The open strikes by node, each with its decision form (``form``: a refused decision, shown
    with its errors on its strike), and the decided ones."""
    groups, decided = trust_selectors.strike_queue()
    refused = {form.prefix: form} if form is not None else {}

    def form_of(pk: int) -> StrikeDecisionForm:
        return refused.get(f"strike-{pk}") or StrikeDecisionForm(strike_pk=pk)

    rows = [(group.node, [(v, form_of(v.strike.pk)) for v in group.strikes]) for group in groups]
    return {"groups": rows, "open_count": sum(len(group.strikes) for group in groups), "decided": decided}


def _strike_page(request: HtmxRequest, *, form: StrikeDecisionForm | None = None, status: int = 200) -> HttpResponse:
    page = "web/partials/strike_queue.html" if request.htmx else "web/admin_strikes.html"
    return render(request, page, _strike_lists(form), status=status)


@staff_required
@require_GET
def strikes(request: HtmxRequest) -> HttpResponse:
    return _strike_page(request)


@staff_required
@require_GET
def strike_lists_fragment(request: HttpRequest) -> HttpResponse:
    """The queue's lists alone, which an open queue fetches when a strike opens or is decided."""
    return render(request, "web/partials/strike_lists.html", _strike_lists())


@staff_required
@require_GET
def todo_fragment(request: HttpRequest) -> HttpResponse:
    return render(request, "web/partials/admin_todo.html", {"todo": trust_selectors.admin_todo()})


def _decide_strike(request: HtmxRequest, pk: int, *, overturn: bool) -> HttpResponse:
    strike = trust_selectors.strike_by_pk(pk)
    if strike is None:
        raise Http404("no such strike")
    form = StrikeDecisionForm(request.POST, strike_pk=pk, require_reason=overturn)
    if form.is_valid():
        reason = form.cleaned_data["reason"]
        try:
            if overturn:
                strike = strike_services.overturn_strike(strike, by=request.user, reason=reason)
            else:
                strike = strike_services.uphold_strike(strike, by=request.user, reason=reason)
        except StrikeDecisionRefused as exc:
            form.add_error(None, str(exc))
        else:
            done = "overturned" if strike.state == StrikeState.OVERTURNED else "upheld"
            node = strike.node
            ejected = f" {node.name} was ejected: {node.ejection_reason}." if node.state == NodeState.EJECTED else ""
            messages.success(request, f"Strike {strike.pk} on {node.name} {done}.{ejected}")
            return _strike_page(request) if request.htmx else redirect("web:strikes")
    # HTMX swaps only successful answers: the form with its errors comes back as a 200 there.
    return _strike_page(request, form=form, status=200 if request.htmx else 400)


@staff_required
@require_POST
def strike_uphold(request: HtmxRequest, pk: int) -> HttpResponse:
    return _decide_strike(request, pk, overturn=False)


@staff_required
@require_POST
def strike_overturn(request: HtmxRequest, pk: int) -> HttpResponse:
    return _decide_strike(request, pk, overturn=True)


def _payouts_page(request: HtmxRequest) -> HttpResponse:
    page = "web/partials/payouts_panel.html" if request.htmx else "web/admin_payouts.html"
    return render(request, page, {"payouts": trust_selectors.payouts_view()})


@staff_required
@require_GET
def payouts(request: HtmxRequest) -> HttpResponse:
    return _payouts_page(request)


@staff_required
@require_POST
def payouts_build(request: HtmxRequest) -> HttpResponse:
    batch = payout_services.build_batch()
    if batch is None:
        messages.info(request, "Nobody is due a payout: no provider with a payout-ready account is above the minimum.")
    else:
        count = batch.payouts.count()
        plural = "s" if count != 1 else ""
        messages.success(request, f"Batch {batch.pk} built: {count} payout{plural}, awaiting approval.")
    return _payouts_page(request) if request.htmx else redirect("web:payouts")


@staff_required
@require_POST
def payouts_approve(request: HtmxRequest, pk: int) -> HttpResponse:
    batch = trust_selectors.batch_by_pk(pk)
    if batch is None:
        raise Http404("no such batch")
    try:
        batch = payout_services.approve_batch(batch, by=request.user)
    except PayoutRefused as exc:
        messages.error(request, str(exc))
    else:
        # The transfers went out when the approval committed; say how they went.
        states = list(batch.payouts.values_list("state", flat=True))
        sent, failed = states.count(PayoutState.SENT), states.count(PayoutState.FAILED)
        messages.success(
            request,
            f"Batch {batch.pk} approved: {sent} sent, {failed} failed, {len(states) - sent - failed} still sending.",
        )
    return _payouts_page(request) if request.htmx else redirect("web:payouts")


def _node_action(request: HtmxRequest, node: Node | None = None, form: EjectForm | None = None, status: int = 200):
    """The swarm page's action panel (an eject form, or what the last action did)."""
    context = {"action_node": node, "form": form}
    if request.htmx:
        return render(request, "web/partials/node_action.html", context, status=status)
    return render(request, "web/admin_swarm.html", context | _swarm_page_context(), status=status)


def _any_node(pk: int) -> Node:
    node = selectors.node_by_pk(pk)
    if node is None:
        raise Http404("no such node")
    return node


@staff_required
@require_http_methods(["GET", "POST"])
def node_eject(request: HtmxRequest, pk: int) -> HttpResponse:
    node = _any_node(pk)
    if request.method == "GET":
        return _node_action(request, node, EjectForm())
    form = EjectForm(request.POST)
    if not form.is_valid():
        return _node_action(request, node, form, status=200 if request.htmx else 400)
    if node.state == NodeState.EJECTED:
        messages.info(request, f"{node.name} was already ejected: {node.ejection_reason}")
        return _node_action(request) if request.htmx else redirect("web:swarm")
    try:
        node = lifecycle.eject_node(node, reason=form.cleaned_data["reason"], by=request.user)
    except NodeError as exc:
        raise PermissionDenied(str(exc)) from exc
    messages.success(request, f"{node.name} ejected: {node.ejection_reason}")
    return _node_action(request) if request.htmx else redirect("web:swarm")


@staff_required
@require_POST
def node_reinstate(request: HtmxRequest, pk: int) -> HttpResponse:
    node = _any_node(pk)
    if node.state != NodeState.EJECTED:
        messages.info(request, f"{node.name} is not ejected (it is {node.state}).")
        return _node_action(request) if request.htmx else redirect("web:swarm")
    try:
        node = node_services.reinstate_node(node, by=request.user)
    except NodeError as exc:
        raise PermissionDenied(str(exc)) from exc
    messages.success(request, f"{node.name} reinstated: it is {node.state} until its agent reconnects.")
    return _node_action(request) if request.htmx else redirect("web:swarm")
