"""The sign-up form: it checks the inputs' shape (UserCreationForm's username and password
rules); the account rules (at least one role, an email not in use) are the ``sign_up`` service's,
shown on the form by the view."""

from __future__ import annotations

from django import forms
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import UserCreationForm


class SignUpForm(UserCreationForm):
    email = forms.EmailField(required=True)
    provider = forms.BooleanField(required=False, label="I provide GPUs (provider)")
    customer = forms.BooleanField(required=False, label="I buy inference (customer)")

    # The email is not a model field of this form, so the model's exact-case uniqueness check
    # does not run here: the service's check (without case) is the one rule, with one message.
    field_order = ["username", "email", "password1", "password2", "provider", "customer"]

    class Meta:
        model = get_user_model()
        fields = ("username",)
