"""The catalog's admin pages: register a checkpoint (name and source; the rest is read from it), then
enable or disable it, set the reputation its nodes need and its prices in dollars per million
tokens. An entry is never deleted here: jobs, receipts and prices name it (disable it instead)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin

from marketplace.billing.admin import price_field
from marketplace.catalog.errors import CatalogError
from marketplace.catalog.models import DESCRIBED_BY, CatalogModel
from marketplace.flows import offerings

REGISTERED = ("name", "source_kind", "source", "source_sha256", "min_reputation", "enabled")
READ_FROM_CHECKPOINT = (*DESCRIBED_BY, "created_at", "updated_at")
PRICES = ("prompt_price", "completion_price")


def _price_field(tokens: str) -> forms.DecimalField:
    return price_field(
        tokens, required=False, help_text=f"dollars per million {tokens} tokens (empty: as it is, or the default price)"
    )


class RegistrationForm(forms.ModelForm):
    """Registers the checkpoint while it validates: its refusal (a missing config.json, an
    unsupported architecture, ...) is shown on the field it is about."""

    prompt_price = _price_field("prompt")
    completion_price = _price_field("completion")

    class Meta:
        model = CatalogModel
        fields = REGISTERED

    def clean(self) -> dict:
        super().clean()
        data = self.cleaned_data  # what a ModelForm's clean returns
        self._validate_unique = False  # the registration checks the name itself, and has created the row
        if self.errors:
            return data
        fields: dict[str, Any] = {name: data.get(name) for name in REGISTERED + PRICES}
        try:
            self.registered = offerings.register(**fields)
        except CatalogError as exc:
            self.add_error(exc.param if exc.param in self.fields else None, exc.message)
        return data


class ChangeForm(forms.ModelForm):
    prompt_price = _price_field("prompt")
    completion_price = _price_field("completion")

    class Meta:
        model = CatalogModel
        fields = ("enabled", "min_reputation")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        prompt, completion = offerings.prices(self.instance.name)
        self.fields["prompt_price"].initial, self.fields["completion_price"].initial = prompt, completion


@admin.register(CatalogModel)
class CatalogModelAdmin(admin.ModelAdmin):
    list_display = ("name", "ref", "source_kind", "architecture", "n_layers", "dtype", "min_reputation", "enabled")
    list_filter = ("enabled", "source_kind", "architecture")
    search_fields = ("name", "content_hash")

    def get_fields(self, request, obj=None):
        if obj is None:
            return [*REGISTERED, *PRICES]
        return [*READ_FROM_CHECKPOINT, "enabled", "min_reputation", *PRICES]

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else READ_FROM_CHECKPOINT

    def get_form(self, request, obj=None, **kwargs):
        kwargs["form"] = RegistrationForm if obj is None else ChangeForm
        return super().get_form(request, obj, **kwargs)

    def save_form(self, request, form, change):
        entry = super().save_form(request, form, change)
        return entry if change else form.registered

    def save_model(self, request, obj, form, change) -> None:
        if change:  # a registration was saved by its form's validation
            prices = {name: form.cleaned_data.get(name) for name in PRICES}
            offerings.update(obj.name, enabled=obj.enabled, min_reputation=obj.min_reputation, **prices)

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
