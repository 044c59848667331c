"""The customers' money and playground pages: billing (balance, top-ups through Stripe Checkout,
one row per request, the ledger one click away) and the playground (a streamed chat on the
customer's own playground key, its reply's figures, the balance kept current).

As in ``views``: a page checks the customer's role, validates its input and calls one service;
another customer's top-up or request answers 404, as if it did not exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import HttpResponseClientRedirect

from marketplace.api.errors import allow_method, error_response
from marketplace.api.openai import complete_for_key
from marketplace.api.parsers import loads_bounded
from marketplace.billing import selectors as billing
from marketplace.billing import stripe_client
from marketplace.billing.models import TopUpState
from marketplace.billing.topups import cancel_top_up, start_top_up
from marketplace.db import releases_db
from marketplace.errors import DomainError
from marketplace.install.script import public_url
from marketplace.jobs import selectors as job_selectors
from marketplace.jobs.errors import AuthenticationFailed, InvalidRequest
from marketplace.web import selectors
from marketplace.web.forms import TopUpForm
from marketplace.web.playground_errors import advice_table
from marketplace.web.services import ensure_playground_key
from marketplace.web.views import HtmxRequest, customer_required, refused_unconfigured

if TYPE_CHECKING:
    from marketplace.logs import IdentifiedRequest

REQUESTS_PER_PAGE = 20
LEDGER_ROWS = 200


# --- billing --------------------------------------------------------------------------------------


def _billing_context(request: HttpRequest) -> dict:
    user = request.user
    top_ups = selectors.top_ups(user)
    return {
        "balance": billing.balance(user),
        "totals": billing.totals(user),
        "top_ups": top_ups,
        "pending": any(t.state == TopUpState.PENDING for t in top_ups),
        "returned": request.GET.get("top_up", ""),
    }


def _billing_page(request: HttpRequest, form: TopUpForm, status: int = 200) -> HttpResponse:
    page = Paginator(job_selectors.customer_requests(request.user), REQUESTS_PER_PAGE).get_page(request.GET.get("page"))
    context = _billing_context(request) | {
        "form": form,
        "requests_page": page,
        "requests": job_selectors.request_rows(page.object_list),
    }
    return render(request, "web/customer_billing.html", context, status=status)


@customer_required
@require_GET
def billing_page(request: HttpRequest) -> HttpResponse:
    return _billing_page(request, TopUpForm())


@customer_required
@require_GET
def balance_fragment(request: HttpRequest) -> HttpResponse:
    return render(request, "web/partials/balance.html", _billing_context(request))


@customer_required
@require_GET
def ledger(request: HttpRequest) -> HttpResponse:
    """Every movement of the customer's money, as the ledger records it (optionally one request's)."""
    job = request.GET.get("request", "")[:64]
    context = {"transactions": billing.transactions(request.user, limit=LEDGER_ROWS, job=job), "job": job}
    return render(request, "web/customer_ledger.html", context | {"limit": LEDGER_ROWS})


@customer_required
@require_POST
def top_up(request: HtmxRequest) -> HttpResponse:
    form = TopUpForm(request.POST)
    if not stripe_client.configured():
        form.add_error(None, stripe_client.TOP_UPS_UNAVAILABLE)
        page = (
            render(request, "web/partials/top_up_form.html", {"form": form}, status=503)
            if request.htmx
            else _billing_page(request, form, status=503)
        )
        return refused_unconfigured(page, "a top-up")
    if form.is_valid():
        amount = str(form.cleaned_data["amount"])
        try:
            _, checkout_url = start_top_up(request.user, amount, origin=public_url(request))
        except DomainError as exc:
            form.add_error("amount" if exc.param == "amount" else None, str(exc))
        else:
            # Off to Stripe's page; the credits arrive with Stripe's signed webhook, not with the return.
            if request.htmx:
                return HttpResponseClientRedirect(checkout_url)
            return redirect(checkout_url)
    if request.htmx:
        return render(request, "web/partials/top_up_form.html", {"form": form})
    return _billing_page(request, form, status=400)


@customer_required
@require_GET
def top_up_cancelled(request: HttpRequest, pk: int) -> HttpResponse:
    """Stripe Checkout's cancel link: the top-up is cancelled at once, and the billing page says so."""
    top_up = selectors.top_up_of(request.user, pk)
    if top_up is None:
        raise Http404("no such top-up")
    cancel_top_up(top_up)
    return redirect(f"{reverse('web:billing')}?top_up=cancelled")


# --- playground -----------------------------------------------------------------------------------


@customer_required
@require_GET
def playground(request: HttpRequest) -> HttpResponse:
    context = {
        "models": selectors.servable_models(),
        "balance": billing.balance(request.user),
        "max_tokens_limit": settings.SWARM_MAX_TOKENS_LIMIT,
        "advice": advice_table(),
    }
    return render(request, "web/customer_playground.html", context)


@releases_db
@allow_method("POST")
async def playground_chat(request: IdentifiedRequest) -> HttpResponseBase:
    """A chat completion for the signed-in customer, streamed, admitted exactly as the public API
    admits one (validation, rate limits, credits, capacity) on their playground key. The page's Stop
    button hangs up, which cancels the job as any client leaving mid-stream does."""
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
    """The reply's figures, polled until it is settled; each answer also brings the balance up to date."""
    job = selectors.job_of(request.user, public_id)
    if job is None:
        raise Http404("no such job")
    context = {"job": job, "settled": job.settled_at is not None, "balance": billing.balance(request.user)}
    return render(request, "web/partials/playground_stats.html", context)
