from django.contrib import admin

from marketplace.billing.models import LedgerAccount, ModelPrice, Transfer


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    """Admins set prices (nano-dollars per million tokens); a new row with a later effective_from
    takes over, so the price each job paid stays on record."""

    list_display = ("model", "prompt_per_million", "completion_per_million", "effective_from")
    list_filter = ("model",)


@admin.register(LedgerAccount)
class LedgerAccountAdmin(admin.ModelAdmin):
    list_display = ("kind", "owner", "balance")
    list_filter = ("kind",)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Transfer)
class TransferAdmin(LedgerAccountAdmin):
    list_display = ("id", "kind", "debit", "credit", "amount", "job", "reference", "created_at")
    list_filter = ("kind",)
