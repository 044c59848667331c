"""HTTP entry points of Stripe top-ups: a customer asks for one (`POST /api/v1/billing/top-ups`), and
Stripe reports what became of it (`POST /stripe/webhook`, signed with STRIPE_WEBHOOK_SECRET)."""

from __future__ import annotations

import stripe
from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import permissions, serializers, status
from rest_framework.decorators import api_view, permission_classes
from rest_framework.request import Request
from rest_framework.response import Response

from marketplace.api.errors import error_response
from marketplace.api.views import IsCustomer
from marketplace.billing import topups
from marketplace.billing.errors import InvalidWebhookPayload, InvalidWebhookSignature, WebhookNotConfigured
from marketplace.errors import DomainError
from marketplace.flows import stripe_events
from marketplace.install.script import public_url

TOP_UP_REQUEST = inline_serializer(
    "TopUpRequest", {"amount": serializers.CharField(help_text='dollars, in whole cents, e.g. "10.00"')}
)
TOP_UP_CREATED = inline_serializer(
    "TopUpCreated",
    {"id": serializers.IntegerField(), "checkout_url": serializers.URLField(), "state": serializers.CharField()},
)


@extend_schema(
    request=TOP_UP_REQUEST,
    responses={
        201: TOP_UP_CREATED,
        400: OpenApiResponse(description="amount missing, malformed or out of range"),
        402: OpenApiResponse(description="the payment provider refused the top-up"),
        503: OpenApiResponse(description="the payment provider is unavailable"),
    },
)
@api_view(["POST"])
@permission_classes([permissions.IsAuthenticated, IsCustomer])
def top_ups(request: Request) -> Response | JsonResponse:
    """Start a top-up: answers the Stripe Checkout page to pay on. Credits arrive once Stripe confirms the
    payment; Stripe sends the customer back to the dashboard's billing page on this request's host."""
    amount = request.data.get("amount") if isinstance(request.data, dict) else None
    try:
        top_up, checkout_url = topups.start_top_up(request.user, amount, origin=public_url(request))
    except DomainError as exc:
        return error_response(exc)
    return Response(
        {"id": top_up.pk, "checkout_url": checkout_url, "state": top_up.state}, status=status.HTTP_201_CREATED
    )


@csrf_exempt
@require_POST
def stripe_webhook(request: HttpRequest) -> JsonResponse:
    """Verify Stripe's signature over the raw body, then apply the event once."""
    secret = settings.STRIPE_WEBHOOK_SECRET
    if not secret:
        return error_response(WebhookNotConfigured("Stripe webhooks are not configured on this server"))
    try:
        event = stripe.Webhook.construct_event(
            request.body,
            request.headers.get("Stripe-Signature"),
            secret,
            tolerance=settings.STRIPE_WEBHOOK_TOLERANCE_S,
        )
    except ValueError:
        return error_response(InvalidWebhookPayload("the payload is not a JSON event"))
    except stripe.SignatureVerificationError:
        return error_response(InvalidWebhookSignature("the Stripe-Signature header does not verify"))
    outcome = stripe_events.handle_event(event.to_dict())
    return JsonResponse({"received": True, "outcome": outcome})
