"""Admin review of strikes (uphold / overturn with a reason) and of the checks behind them."""

from __future__ import annotations

from django.contrib import admin

from marketplace.admin_actions import ReadOnlyAdmin, with_reason
from marketplace.billing.admin import money_column
from marketplace.verification import strikes
from marketplace.verification.models import Audit, Challenge, Strike, StrikeState

CLAWED_BACK = money_column("clawed_back", "clawed back")


@admin.register(Strike)
class StrikeAdmin(admin.ModelAdmin):
    list_display = ("id", "node", "kind", "state", "created_at", "decided_by", CLAWED_BACK)
    list_filter = ("state", "kind")
    readonly_fields = [f.name for f in Strike._meta.fields]
    actions = ["uphold", "overturn"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.action(description="Uphold: claw back pending pay (ejects past the threshold)")
    def uphold(self, request, queryset):
        return with_reason(
            self,
            request,
            queryset.filter(state=StrikeState.OPEN),
            title="Uphold strikes",
            apply=lambda strike, reason: strikes.uphold_strike(strike, by=request.user, reason=reason),
        )

    @admin.action(description="Overturn (a reason is required)")
    def overturn(self, request, queryset):
        return with_reason(
            self,
            request,
            queryset.filter(state=StrikeState.OPEN),
            title="Overturn strikes",
            apply=lambda strike, reason: strikes.overturn_strike(strike, by=request.user, reason=reason),
        )


@admin.register(Challenge)
class ChallengeAdmin(ReadOnlyAdmin):
    list_display = ("id", "node", "model", "layer_start", "layer_end", "state", "sent_at", "elapsed_ms")
    list_filter = ("state",)
    exclude = ("output",)


@admin.register(Audit)
class AuditAdmin(ReadOnlyAdmin):
    list_display = ("id", "node", "job", "session", "stage", "state", "created_at")
    list_filter = ("state",)
    exclude = ("material",)
