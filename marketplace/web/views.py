"""The dashboards: server-rendered pages and the HTMX fragments they swap in.

Each view checks who may see it, validates its form and calls one service of the app that owns
the data (nodes, jobs, billing, verification, payouts); reads go through selectors. A user without
the page's role gets 403; another provider's node or another customer's key or job answers 404, as
if it did not exist. The admins' pages and actions (deciding strikes, approving payouts, ejecting
nodes) live in admin_views.py: POST forms with CSRF, for staff only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import stripe
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from django_htmx.http import HttpResponseClientRedirect

from marketplace.api.errors import allow_method, error_response
from marketplace.api.openai import complete_for_key, releases_db
from marketplace.api.parsers import loads_bounded
from marketplace.billing import selectors as billing
from marketplace.billing.errors import PaymentProviderUnavailable
from marketplace.billing.models import TopUpState
from marketplace.billing.topups import start_top_up
from marketplace.errors import DomainError
from marketplace.install.script import install_command
from marketplace.install.views import public_url
from marketplace.jobs import services as jobs_services
from marketplace.jobs.errors import ApiKeyLimitReached, ApiKeyNameTaken, AuthenticationFailed, InvalidRequest
from marketplace.nodes import services as node_services
from marketplace.nodes.errors import NodeError, NodeNameTaken
from marketplace.payouts import services as payout_services
from marketplace.payouts.errors import PayoutRefused
from marketplace.placement import services as placement_services
from marketplace.web import selectors, trust_selectors
from marketplace.web.forms import ApiKeyForm, NodeForm, TopUpForm
from marketplace.web.services import ensure_playground_key

USAGE_GROUPS = ("day", "model", "key")


def role_required(check: Callable) -> Callable:
    """Sign-in first (a redirect to the login page), then the role: 403 without it."""

    def decorator(view):
        @functools.wraps(view)
        def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            if not check(request.user):
                raise PermissionDenied("this page is not for your account's role")
            return view(request, *args, **kwargs)

        return wrapped

    return decorator


provider_required = role_required(lambda user: user.is_provider)
customer_required = role_required(lambda user: user.is_customer)
staff_required = role_required(lambda user: user.is_staff)


# --- home -----------------------------------------------------------------------------------------


@login_required
@require_GET
def home(request: HttpRequest) -> HttpResponse:
    user = request.user
    if user.is_customer and request.GET.get("top_up"):  # back from Stripe Checkout
        return redirect(f"{reverse('web:billing')}?{request.GET.urlencode()}")
    return render(request, "web/home.html", {"overview": selectors.home_overview(user)})


# --- providers ------------------------------------------------------------------------------------


def _form_panel(request: HttpRequest, partial: str, page: str, form, context: dict) -> HttpResponse:
    """A panel with a form: just the panel for HTMX (which swaps it in), else the whole page;
    a refused form answers 400 on a full page load."""
    status = 400 if form.errors and not request.htmx else 200
    return render(request, partial if request.htmx else page, context, status=status)


def _install_command(request: HttpRequest, token: str) -> str:
    """The one line a provider pastes on the machine: the control plane's install script, which
    installs the agent and joins with the token."""
    return install_command(public_url(request), token)


def _nodes_panel(request: HttpRequest, form: NodeForm, *, added=None, token: str = "") -> HttpResponse:
    context = {
        "form": form,
        "nodes": selectors.provider_nodes(request.user),
        "added": added,
        "command": _install_command(request, token) if token else "",
    }
    return _form_panel(request, "web/partials/nodes_panel.html", "web/provider_nodes.html", form, context)


@provider_required
@require_http_methods(["GET", "POST"])
def nodes(request: HttpRequest) -> HttpResponse:
    if request.method == "GET":
        return _nodes_panel(request, NodeForm())
    form = NodeForm(request.POST)
    if not form.is_valid():
        return _nodes_panel(request, form)
    try:
        node, token = node_services.create_node(owner=request.user, **form.cleaned_data)
    except NodeNameTaken as exc:
        form.add_error(exc.param, str(exc))
        return _nodes_panel(request, form)
    except NodeError as exc:
        raise PermissionDenied(str(exc)) from exc
    return _nodes_panel(request, NodeForm(), added=node, token=token)


def _own_node(request: HttpRequest, pk: int):
    node = selectors.node_of(request.user, pk)
    if node is None:
        raise Http404("no such node")
    return node


def _node_page(node) -> dict:
    return {"status": selectors.node_status(node), "node": node, "trust": trust_selectors.node_trust(node)}


@provider_required
@require_GET
def node_detail(request: HttpRequest, pk: int) -> HttpResponse:
    return render(request, "web/provider_node.html", _node_page(_own_node(request, pk)))


@provider_required
@require_GET
def node_trust_fragment(request: HttpRequest, pk: int) -> HttpResponse:
    trust = trust_selectors.node_trust(_own_node(request, pk))
    return render(request, "web/partials/node_trust.html", {"trust": trust})


@provider_required
@require_GET
def node_status_fragment(request: HttpRequest, pk: int) -> HttpResponse:
    return render(request, "web/partials/node_status.html", {"status": selectors.node_status(_own_node(request, pk))})


@provider_required
@require_GET
def node_row_fragment(request: HttpRequest, pk: int) -> HttpResponse:
    return render(request, "web/partials/node_row.html", {"status": selectors.node_status(_own_node(request, pk))})


@provider_required
@require_POST
def node_rotate_token(request: HttpRequest, pk: int) -> HttpResponse:
    node = _own_node(request, pk)
    token = node_services.rotate_join_token(node)
    context = {"node": node, "command": _install_command(request, token)}
    if request.htmx:
        return render(request, "web/partials/join_command.html", context)
    return render(request, "web/provider_node.html", _node_page(node) | context)


@provider_required
@require_POST
def node_drain(request: HttpRequest, pk: int) -> HttpResponse:
    node = placement_services.drain_node(_own_node(request, pk))
    if request.htmx:
        return render(request, "web/partials/node_status.html", {"status": selectors.node_status(node)})
    return redirect("web:node", pk=node.pk)


def _earnings_page(request: HttpRequest, *, connect_error: str = "", status: int = 200) -> HttpResponse:
    context = {
        "earnings": trust_selectors.earnings_view(request.user),
        "returned": request.GET.get("connect", ""),
        "connect_error": connect_error,
    }
    return render(request, "web/provider_earnings.html", context, status=status)


@provider_required
@require_GET
def earnings(request: HttpRequest) -> HttpResponse:
    if request.GET.get("connect") != "done":
        return _earnings_page(request)
    # Back from Stripe's onboarding: ask Stripe what the account can do now.
    try:
        payout_services.refresh_connect(request.user)
    except (PaymentProviderUnavailable, stripe.StripeError) as exc:
        return _earnings_page(request, connect_error=f"Could not ask Stripe about your account: {exc}")
    return _earnings_page(request)


@provider_required
@require_POST
def connect_stripe(request: HttpRequest) -> HttpResponse:
    """Off to Stripe's onboarding for the provider's Connect account; Stripe sends them back to
    the earnings page with ``?connect=done`` (or ``?connect=refresh`` when the link expired)."""
    try:
        url = payout_services.start_onboarding(request.user)
    except PayoutRefused as exc:
        raise PermissionDenied(str(exc)) from exc
    except PaymentProviderUnavailable as exc:
        return _earnings_page(request, connect_error=str(exc), status=503)
    except stripe.StripeError as exc:
        return _earnings_page(request, connect_error=f"Stripe refused: {exc.user_message or exc}", status=502)
    return redirect(url)


# --- customers ------------------------------------------------------------------------------------


def _keys_panel(request: HttpRequest, form: ApiKeyForm, *, created=None, key: str = "") -> HttpResponse:
    context = {"form": form, "keys": selectors.api_keys(request.user), "created": created, "full_key": key}
    return _form_panel(request, "web/partials/keys_panel.html", "web/customer_keys.html", form, context)


@customer_required
@require_http_methods(["GET", "POST"])
def keys(request: HttpRequest) -> HttpResponse:
    if request.method == "GET":
        return _keys_panel(request, ApiKeyForm())
    form = ApiKeyForm(request.POST)
    if not form.is_valid():
        return _keys_panel(request, form)
    try:
        api_key, key = jobs_services.create_api_key(request.user, form.cleaned_data["name"])
    except (ApiKeyNameTaken, ApiKeyLimitReached) as exc:
        form.add_error(exc.param, str(exc))
        return _keys_panel(request, form)
    return _keys_panel(request, ApiKeyForm(), created=api_key, key=key)


@customer_required
@require_POST
def key_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    api_key = selectors.key_of(request.user, pk)
    if api_key is None:
        raise Http404("no such key")
    jobs_services.revoke_api_key(api_key)
    if request.htmx:
        return _keys_panel(request, ApiKeyForm())
    return redirect("web:keys")


def _billing_context(request: HttpRequest) -> dict:
    user = request.user
    top_ups = selectors.top_ups(user)
    return {
        "balance": billing.balance(user),
        "totals": billing.totals(user),
        "transactions": billing.transactions(user, limit=50),
        "top_ups": top_ups,
        "pending": any(t.state == TopUpState.PENDING for t in top_ups),
        "returned": request.GET.get("top_up", ""),
    }


@customer_required
@require_GET
def billing_page(request: HttpRequest) -> HttpResponse:
    return render(request, "web/customer_billing.html", _billing_context(request) | {"form": TopUpForm()})


@customer_required
@require_GET
def balance_fragment(request: HttpRequest) -> HttpResponse:
    return render(request, "web/partials/balance.html", _billing_context(request))


@customer_required
@require_POST
def top_up(request: HttpRequest) -> HttpResponse:
    form = TopUpForm(request.POST)
    if form.is_valid():
        try:
            _, checkout_url = start_top_up(request.user, str(form.cleaned_data["amount"]))
        except DomainError as exc:
            form.add_error("amount" if exc.param == "amount" else None, str(exc))
        else:
            # Off to Stripe's page; the credits arrive with Stripe's signed webhook, not with the return.
            if request.htmx:
                return HttpResponseClientRedirect(checkout_url)
            return redirect(checkout_url)
    if request.htmx:
        return render(request, "web/partials/top_up_form.html", {"form": form})
    return render(request, "web/customer_billing.html", _billing_context(request) | {"form": form}, status=400)


@customer_required
@require_GET
def usage(request: HttpRequest) -> HttpResponse:
    group = request.GET.get("group", "day")
    if group not in USAGE_GROUPS:
        group = "day"
    return render(
        request,
        "web/customer_usage.html",
        {"usage": selectors.usage_view(request.user, group), "groups": USAGE_GROUPS},
    )


@customer_required
@require_GET
def playground(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "web/customer_playground.html",
        {
            "models": selectors.servable_models(),
            "balance": billing.balance(request.user),
            "max_tokens_limit": settings.SWARM_MAX_TOKENS_LIMIT,
        },
    )


@releases_db
@allow_method("POST")
async def playground_chat(request: HttpRequest) -> HttpResponse:
    """A chat completion for the signed-in customer, streamed, admitted exactly as the public API
    admits one (validation, rate limits, credits, capacity) on their playground key."""
    user = await request.auser()
    if not user.is_authenticated:
        return error_response(AuthenticationFailed("Sign in to use the playground.", code="not_signed_in"))
    if not user.is_customer:
        return error_response(InvalidRequest("The playground is for customers.", code="not_a_customer"))
    try:
        data = loads_bounded(request.body or b"")
    except InvalidRequest:
        data = None
    if not isinstance(data, dict):
        return error_response(InvalidRequest("The request body must be a JSON object.", code="invalid_json"))
    body = {
        "model": data.get("model"),
        "messages": data.get("messages"),
        "max_tokens": data.get("max_tokens"),
        "temperature": data.get("temperature"),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    api_key = await sync_to_async(ensure_playground_key)(user)
    return await complete_for_key(api_key, body, "chat", request.request_id)


@customer_required
@require_GET
def playground_job(request: HttpRequest, public_id: str) -> HttpResponse:
    job = selectors.job_of(request.user, public_id)
    if job is None:
        raise Http404("no such job")
    return render(
        request,
        "web/partials/playground_stats.html",
        {"job": job, "cost": billing.money(job.charged_amount), "settled": job.settled_at is not None},
    )
