"""Admin: payout batches (build, review, approve), payouts (flagged failures), earnings, accounts."""

from __future__ import annotations

from django.contrib import admin, messages

from marketplace.admin_actions import ReadOnlyAdmin
from marketplace.billing.admin import money_column
from marketplace.payouts import services
from marketplace.payouts.errors import PayoutError
from marketplace.payouts.models import ConnectAccount, Earning, Payout, PayoutBatch

AMOUNT = money_column("amount", "amount")
SENT = money_column("cents", "transfer (whole cents)", scale="cents")
TOTAL = money_column("total", "total")


class PayoutInline(admin.TabularInline):
    model = Payout
    # Django takes callables in fields and readonly_fields (shown read-only); the stubs allow names only.
    fields = ("provider", AMOUNT, SENT, "state", "stripe_transfer_id", "attempts", "last_error", "flagged")  # type: ignore[assignment]
    readonly_fields = fields  # type: ignore[assignment]
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(PayoutBatch)
class PayoutBatchAdmin(admin.ModelAdmin):
    list_display = ("id", "state", TOTAL, "created_at", "approved_by", "approved_at")
    list_filter = ("state",)
    # Django takes callables in fields and readonly_fields (shown read-only); the stubs allow names only.
    fields = ("state", TOTAL, "created_at", "approved_by", "approved_at")  # type: ignore[assignment]
    readonly_fields = fields  # type: ignore[assignment]
    inlines = [PayoutInline]
    actions = ["approve"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.action(description="Approve: send these payouts")
    def approve(self, request, queryset):
        done = 0
        for batch in queryset:
            try:
                services.approve_batch(batch, by=request.user)
                done += 1
            except PayoutError as exc:
                self.message_user(request, f"{batch}: {exc}", messages.ERROR)
        self.message_user(request, f"Approved {done} batch(es)")


@admin.register(Payout)
class PayoutAdmin(ReadOnlyAdmin):
    list_display = ("id", "batch", "provider", AMOUNT, SENT, "state", "attempts", "flagged", "stripe_transfer_id")
    list_filter = ("state", "flagged")
    exclude = ("amount", "cents", "carried_in")
    # Django takes callables in fields and readonly_fields (shown read-only); the stubs allow names only.
    readonly_fields = (AMOUNT, SENT, money_column("carried_in", "carried in (earlier sub-cent rests)"))  # type: ignore[assignment]


@admin.register(Earning)
class EarningAdmin(ReadOnlyAdmin):
    list_display = ("id", "provider", "node", "job", AMOUNT, "layer_tokens", "state", "available_at")
    list_filter = ("state",)
    exclude = ("amount",)
    # Django takes callables in fields and readonly_fields (shown read-only); the stubs allow names only.
    readonly_fields = (AMOUNT,)  # type: ignore[assignment]


@admin.register(ConnectAccount)
class ConnectAccountAdmin(ReadOnlyAdmin):
    list_display = ("provider", "stripe_account_id", "payouts_enabled", "details_submitted", "refreshed_at")
