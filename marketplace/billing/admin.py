from django.contrib import admin

from marketplace.admin_actions import ReadOnlyAdmin
from marketplace.billing.models import LedgerAccount, ModelPrice, Transfer


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    """Admins set prices (nano-dollars per million tokens); a new row with a later effective_from
    takes over, so the price each job paid stays on record."""

    list_display = ("model", "prompt_per_million", "completion_per_million", "effective_from")
    list_filter = ("model",)


@admin.register(LedgerAccount)
class LedgerAccountAdmin(ReadOnlyAdmin):
    list_display = ("kind", "owner", "balance")
    list_filter = ("kind",)


@admin.register(Transfer)
class TransferAdmin(LedgerAccountAdmin):
    list_display = ("id", "kind", "debit", "credit", "amount", "job", "reference", "created_at")
    list_filter = ("kind",)
