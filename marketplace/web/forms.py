"""Forms of the dashboards: they check and label the inputs the services take. Business rules
(a key name already in use, an email already taken) live in the services, which the API calls
too; a view shows a service's refusal on its form with ``form.add_error``."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from django import forms
from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator

from marketplace.billing.display import usd_text
from marketplace.nodes.models import Privacy

NAME = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}$",
    "Use letters, digits, spaces, dots, dashes or underscores, starting with a letter or digit.",
)
REGION = RegexValidator(r"^[a-z0-9-]{1,64}$", "Use lower-case letters, digits and dashes.")


class NodeForm(forms.Form):
    name = forms.CharField(label="Node name", max_length=100, validators=[NAME], help_text="e.g. gpu-1")
    region = forms.CharField(
        label="Region", max_length=64, initial="local", validators=[REGION], help_text="where the machine is"
    )
    max_layers = forms.IntegerField(
        label="At most layers",
        min_value=1,
        max_value=100_000,
        required=False,
        help_text="optional: the most model layers it may hold at once (default: as many as its memory allows)",
    )


PRIVACY_HELP = "which nodes every request of the key may pass through (see Privacy)"


class ApiKeyForm(forms.Form):
    name = forms.CharField(label="Key name", max_length=100, validators=[NAME], help_text="e.g. my-app")
    privacy = forms.ChoiceField(
        label="Nodes", choices=Privacy.choices, initial=Privacy.ANY, required=False, help_text=PRIVACY_HELP
    )

    def clean_privacy(self) -> str:
        return self.cleaned_data["privacy"] or str(Privacy.ANY)  # not sent: any node, as a key made by the API


class KeyPrivacyForm(forms.Form):
    privacy = forms.ChoiceField(label="Nodes", choices=Privacy.choices)


class TopUpForm(forms.Form):
    amount = forms.DecimalField(label="Amount (USD)", max_digits=9, decimal_places=2, initial=Decimal("10.00"))

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        low, high = settings.STRIPE_TOPUP_MIN_DOLLARS, settings.STRIPE_TOPUP_MAX_DOLLARS
        field = self.fields["amount"]
        field.validators += [
            MinValueValidator(low, message=f"The least you can add at once is {usd_text(low)}."),
            MaxValueValidator(high, message=f"The most you can add at once is {usd_text(high)}."),
        ]
        field.error_messages["max_decimal_places"] = "Give dollars and cents: at most 2 digits after the point."
        field.error_messages["invalid"] = "Give an amount in dollars, e.g. 10 or 12.50."
        field.widget.attrs.update(min=str(low), max=str(high), step="0.01")
        field.help_text = f"between {usd_text(low)} and {usd_text(high)}"


class StrikeDecisionForm(forms.Form):
    """An admin's decision on one strike; several sit on one page, so each takes the strike's prefix."""

    reason = forms.CharField(
        label="Reason",
        max_length=2000,
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="Kept with the decision and shown to the node's owner. Required to overturn.",
    )

    def __init__(
        self, data: Mapping[str, Any] | None = None, *, strike_pk: int, require_reason: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(data, prefix=f"strike-{strike_pk}", **kwargs)
        self.require_reason = require_reason

    def clean_reason(self) -> str:
        reason = self.cleaned_data["reason"].strip()
        if self.require_reason and not reason:
            raise forms.ValidationError("Overturning a strike needs a reason.")
        return reason


class EjectForm(forms.Form):
    reason = forms.CharField(
        label="Reason",
        max_length=2000,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="Kept on the node and shown to its owner.",
    )
