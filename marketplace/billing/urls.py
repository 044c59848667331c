from django.urls import path

from marketplace.billing import webhooks

app_name = "billing"

urlpatterns = [
    path("api/v1/billing/top-ups", webhooks.top_ups, name="top-ups"),
    path("stripe/webhook", webhooks.stripe_webhook, name="stripe-webhook"),
]
