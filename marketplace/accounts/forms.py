from __future__ import annotations

from django import forms
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import UserCreationForm


class SignUpForm(UserCreationForm):
    email = forms.EmailField(required=True)
    provider = forms.BooleanField(required=False, label="I provide GPUs (provider)")
    customer = forms.BooleanField(required=False, label="I buy inference (customer)")

    class Meta:
        model = get_user_model()
        fields = ("username", "email")

    def clean_email(self) -> str:
        email = self.cleaned_data["email"].lower()
        if get_user_model().objects.filter(email__iexact=email).exists():
            raise forms.ValidationError("An account with this email already exists.")
        return email

    def clean(self):
        cleaned = super().clean()
        if not (cleaned.get("provider") or cleaned.get("customer")):
            raise forms.ValidationError("Choose at least one role: provider or customer.")
        return cleaned
