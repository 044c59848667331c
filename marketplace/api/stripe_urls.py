"""Stripe top-ups over HTTP, under the ``billing`` URL namespace."""

from django.urls import path

from marketplace.api import stripe_webhooks

app_name = "billing"

urlpatterns = [
    path("api/v1/billing/top-ups", stripe_webhooks.top_ups, name="top-ups"),
    path("stripe/webhook", stripe_webhooks.stripe_webhook, name="stripe-webhook"),
]
