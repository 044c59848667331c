"""Admin: model prices (entered and shown in dollars per million tokens), ledger accounts and
transfers (read only, amounts in dollars with the exact amount on hover).

``money_column`` is the admin's one way to show a nano-dollar field; the other apps' admin pages
(payouts, jobs, strikes) use it too.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal

from django import forms
from django.contrib import admin
from django.utils import timezone
from django.utils.html import format_html

from marketplace.admin_actions import ReadOnlyAdmin
from marketplace.billing import display
from marketplace.billing.models import NANO_PER_DOLLAR, LedgerAccount, ModelPrice, Transfer

MAX_DOLLARS_PER_MILLION = Decimal(1_000_000)


def money_column(field: str, description: str, *, scale: str = "nano") -> Callable:
    """A read-only admin column (or field) for the integer amount ``field``, as the pages show money
    (``display.usd_text``), the exact amount on hover. ``scale`` is the field's unit: "nano"
    (nano-dollars) or "cents"."""

    def show(obj) -> str:
        value = getattr(obj, field)
        if value is None:
            return display.MISSING
        amount = display.dollars(value) if scale == "nano" else Decimal(value) / 100
        shown, exact = display.usd_text(amount), display.usd_exact(amount)
        return format_html('<span title="{}">{}</span>', exact, shown) if exact != shown else shown

    show.__name__ = f"{field}_usd"
    return admin.display(description=description, ordering=field)(show)


def price_field(tokens: str, *, required: bool = True, help_text: str = "") -> forms.DecimalField:
    """A price typed in dollars per million ``tokens`` tokens (the admins' unit, here and in the
    catalog's forms); the form stores it in the ledger's nano-dollars."""
    return forms.DecimalField(
        label=f"{tokens.capitalize()} price ($ / 1M tokens)",
        min_value=Decimal(0),
        max_value=MAX_DOLLARS_PER_MILLION,
        max_digits=16,
        decimal_places=9,
        required=required,
        help_text=help_text
        or (
            f"Dollars per million {tokens} tokens, e.g. 0.20 for $0.20 / 1M tokens "
            "(stored as nano-dollars per million tokens)."
        ),
    )


class ModelPriceForm(forms.ModelForm):
    """Prices in dollars per million tokens, stored in the ledger's nano-dollars."""

    prompt_price = price_field("prompt")
    completion_price = price_field("completion")

    class Meta:
        model = ModelPrice
        fields = ("model", "effective_from")
        help_texts = {"effective_from": "From this time on, this price applies; earlier jobs keep the price they paid."}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            self.fields["prompt_price"].initial = display.dollars(self.instance.prompt_per_million)
            self.fields["completion_price"].initial = display.dollars(self.instance.completion_per_million)
        else:
            self.fields["effective_from"].initial = timezone.now

    def save(self, commit: bool = True) -> ModelPrice:
        self.instance.prompt_per_million = int(self.cleaned_data["prompt_price"] * NANO_PER_DOLLAR)
        self.instance.completion_per_million = int(self.cleaned_data["completion_price"] * NANO_PER_DOLLAR)
        return super().save(commit)


def _price_column(field: str, description: str) -> Callable:
    def show(obj: ModelPrice) -> str:
        return display.price_text(getattr(obj, field))

    show.__name__ = f"{field}_text"
    return admin.display(description=description, ordering=field)(show)


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    """Admins set prices in dollars per million tokens; a new row with a later effective_from takes
    over, so the price each job paid stays on record."""

    form = ModelPriceForm
    fields = ("model", "prompt_price", "completion_price", "effective_from")
    list_display = (
        "model",
        _price_column("prompt_per_million", "prompt"),
        _price_column("completion_per_million", "completion"),
        "effective_from",
    )
    list_filter = ("model",)


BALANCE = money_column("balance", "balance")
AMOUNT = money_column("amount", "amount")


@admin.register(LedgerAccount)
class LedgerAccountAdmin(ReadOnlyAdmin):
    list_display = ("kind", "owner", BALANCE)
    list_filter = ("kind",)
    # Django takes callables in fields and readonly_fields (shown read-only); the stubs allow names only.
    fields = ("kind", "owner", BALANCE)  # type: ignore[assignment]
    readonly_fields = (BALANCE,)  # type: ignore[assignment]


@admin.register(Transfer)
class TransferAdmin(ReadOnlyAdmin):
    list_display = ("id", "kind", "debit", "credit", AMOUNT, "job", "reference", "created_at")
    list_filter = ("kind",)
    # Django takes callables in fields and readonly_fields (shown read-only); the stubs allow names only.
    fields = ("kind", "debit", "credit", AMOUNT, "job", "reference", "memo", "created_at")  # type: ignore[assignment]
    readonly_fields = (AMOUNT, "created_at")  # type: ignore[assignment]
