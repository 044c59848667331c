"""The dashboards: server-rendered pages and the HTMX fragments they swap in.

Each view checks who may see it, validates its form and calls one service of the app that owns
the data (nodes, jobs, billing, verification, payouts); reads go through selectors. A user without
the page's role gets 403; another provider's node or another customer's key or job answers 404, as
if it did not exist. The admins' pages and actions (deciding strikes, approving payouts, ejecting
nodes) live in admin_views.py: POST forms with CSRF, for staff only; the customers' billing and
playground, in customer_views.py; a provider's node pages and actions, in node_views.py.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import date

import stripe
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from django_htmx.middleware import HtmxDetails

from marketplace.billing import stripe_client
from marketplace.billing.errors import PaymentProviderUnavailable
from marketplace.install.script import public_url
from marketplace.jobs import services as jobs_services
from marketplace.jobs.errors import ApiKeyLimitReached, ApiKeyNameTaken
from marketplace.nodes.models import Privacy
from marketplace.payouts import services as payout_services
from marketplace.payouts.errors import PayoutRefused
from marketplace.web import landing_selectors, selectors, trust_selectors
from marketplace.web.forms import ApiKeyForm, KeyPrivacyForm

log = logging.getLogger("swarm.web")
USAGE_GROUPS = ("day", "model", "key")


class HtmxRequest(HttpRequest):
    """A request as the dashboards' views get it: ``HtmxMiddleware`` (in MIDDLEWARE) sets ``htmx`` on each."""

    htmx: HtmxDetails


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


def _landing_context(request: HttpRequest) -> dict:
    figures = landing_selectors.swarm_figures()
    example = next((m.name for m in figures.models if m.available), figures.models[0].name if figures.models else "")
    return {"figures": figures, "api_base": f"{public_url(request)}/v1", "example_model": example}


@require_GET
def landing_figures(request: HttpRequest) -> HttpResponse:
    return render(request, "web/partials/landing_figures.html", {"figures": landing_selectors.swarm_figures()})


@require_GET
def home(request: HttpRequest) -> HttpResponse:
    """The front door for visitors; a signed-in person's own overview."""
    user = request.user
    if not user.is_authenticated:
        if request.GET.get("top_up"):  # back from Stripe Checkout, signed out meanwhile
            return redirect_to_login(request.get_full_path())
        return render(request, "web/landing.html", _landing_context(request))
    if user.is_customer and request.GET.get("top_up"):  # back from Stripe Checkout
        return redirect(f"{reverse('web:billing')}?{request.GET.urlencode()}")
    return render(request, "web/home.html", {"overview": selectors.home_overview(user)})


# --- providers (their nodes' pages are node_views.py) ----------------------------------------------


def _form_panel(request: HtmxRequest, partial: str, page: str, form, context: dict) -> HttpResponse:
    """A panel with a form: just the panel for HTMX (which swaps it in), else the whole page;
    a refused form answers 400 on a full page load."""
    status = 400 if form.errors and not request.htmx else 200
    return render(request, partial if request.htmx else page, context, status=status)


def refused_unconfigured(response: HttpResponse, what: str) -> HttpResponse:
    """``response``, refusing ``what`` because no payment provider is configured: a fact of this
    server's configuration, logged at INFO (Django's request log would have an error of a 503)."""
    log.info("%s refused: no payment provider (Stripe) is configured", what)
    response["Retry-After"] = "3600"  # a 503 says when to come back: here, once an operator configured Stripe
    response._has_been_logged = True  # type: ignore[attr-defined]  # django.request's own mark of a logged response
    return response


def _earnings_page(request: HttpRequest, *, connect_error: str = "", status: int = 200) -> HttpResponse:
    """The earnings page; ``?day=YYYY-MM-DD`` (and ``&node=<id>``) shows that day's (and node's)
    per-request rows, one click down from its line of the per-day roll-up."""
    try:
        day = date.fromisoformat(request.GET["day"]) if request.GET.get("day") else None
        node = int(request.GET["node"]) if request.GET.get("node") and day else None
    except ValueError:
        return HttpResponseBadRequest("day must be a date (YYYY-MM-DD) and node a node's number")
    if node is not None and not trust_selectors.owns_node(request.user, node):
        raise Http404("no such node of yours")
    context = {
        "earnings": trust_selectors.earnings_view(request.user, day=day, node=node),
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
    if not stripe_client.configured():
        page = _earnings_page(request, connect_error=stripe_client.PAYOUTS_UNAVAILABLE, status=503)
        return refused_unconfigured(page, "connecting a payout account")
    try:
        url = payout_services.start_onboarding(request.user, origin=public_url(request))
    except PayoutRefused as exc:
        raise PermissionDenied(str(exc)) from exc
    except PaymentProviderUnavailable as exc:
        return _earnings_page(request, connect_error=str(exc), status=503)
    except stripe.StripeError as exc:
        return _earnings_page(request, connect_error=f"Stripe refused: {exc.user_message or exc}", status=502)
    return redirect(url)


# --- customers ------------------------------------------------------------------------------------


def _keys_panel(request: HtmxRequest, form: ApiKeyForm, *, created=None, key: str = "") -> HttpResponse:
    context = {
        "form": form,
        "keys": selectors.api_keys(request.user),
        "created": created,
        "full_key": key,
        "privacy_choices": Privacy.choices,
    }
    if created is not None:  # a ready-to-paste first request with the new key, shown with it once
        context["api_base"] = f"{public_url(request)}/v1"
        context["example_model"] = selectors.example_model()
    return _form_panel(request, "web/partials/keys_panel.html", "web/customer_keys.html", form, context)


@customer_required
@require_http_methods(["GET", "POST"])
def keys(request: HtmxRequest) -> HttpResponse:
    if request.method == "GET":
        return _keys_panel(request, ApiKeyForm())
    form = ApiKeyForm(request.POST)
    if not form.is_valid():
        return _keys_panel(request, form)
    try:
        api_key, key = jobs_services.create_api_key(
            request.user, form.cleaned_data["name"], form.cleaned_data["privacy"]
        )
    except (ApiKeyNameTaken, ApiKeyLimitReached) as exc:
        form.add_error(exc.param, str(exc))
        return _keys_panel(request, form)
    return _keys_panel(request, ApiKeyForm(), created=api_key, key=key)


@customer_required
@require_POST
def key_revoke(request: HtmxRequest, pk: int) -> HttpResponse:
    api_key = selectors.key_of(request.user, pk)
    if api_key is None:
        raise Http404("no such key")
    jobs_services.revoke_api_key(api_key)
    if request.htmx:
        return _keys_panel(request, ApiKeyForm())
    return redirect("web:keys")


@customer_required
@require_POST
def key_privacy(request: HtmxRequest, pk: int) -> HttpResponse:
    """Which nodes the key's requests may pass through, from its next request on."""
    api_key = selectors.key_of(request.user, pk)
    if api_key is None or api_key.revoked_at is not None:
        raise Http404("no such key")
    form = KeyPrivacyForm(request.POST)
    if form.is_valid():
        jobs_services.set_key_privacy(api_key, form.cleaned_data["privacy"])
    if request.htmx:
        return _keys_panel(request, ApiKeyForm())
    return redirect("web:keys")


@customer_required
@require_GET
def privacy(request: HttpRequest) -> HttpResponse:
    """Who sees what of a request, in each privacy mode."""
    return render(request, "web/customer_privacy.html")


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
