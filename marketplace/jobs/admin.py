"""Admin: jobs, read only; unverified ones are flagged with the reason and paid to nobody, and
ones whose settlement keeps failing are flagged with the error (and can be retried at once)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet

from marketplace.billing.admin import money_column
from marketplace.jobs.models import Job

CHARGED = money_column("charged_amount", "charged")
# The money fields, shown in dollars (the exact amount on hover) rather than as raw nano-dollars.
MONEY = {
    "price_prompt_per_million": money_column("price_prompt_per_million", "prompt price ($ / 1M tokens)"),
    "price_completion_per_million": money_column("price_completion_per_million", "completion price ($ / 1M tokens)"),
    "hold_amount": money_column("hold_amount", "hold"),
    "charged_amount": CHARGED,
}


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = (
        "public_id",
        "request_id",
        "customer",
        "model",
        "state",
        "completion_tokens",
        CHARGED,
        "verified",
        "settled_at",
        "settle_flagged",
        "settle_error",
    )
    list_filter = ("settle_flagged", "verified", "state", "model")
    search_fields = ("public_id", "request_id")  # the response's id, or the x-request-id a customer quotes
    exclude = ("transcripts", *MONEY)
    actions = ["retry_settlement"]

    def get_readonly_fields(self, request, obj=None):
        return [MONEY.get(f.name, f.name) for f in Job._meta.fields if f.name != "transcripts"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.action(description="Settle again at the next reconcile (after fixing the cause)")
    def retry_settlement(self, request, queryset: QuerySet[Job]) -> None:
        count = queryset.filter(settled_at__isnull=True).update(settle_retry_at=None)
        self.message_user(request, f"{count} job(s) will be settled at the next reconcile.", messages.SUCCESS)
