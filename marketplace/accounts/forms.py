"""The sign-up form: it checks the inputs' shape (UserCreationForm's username rules, and the
password validators of AUTH_PASSWORD_VALIDATORS); the account rules (at least one role, an email
not in use, the same password validators) are the ``sign_up`` service's, shown on the form by the
view. The sign-in form refuses a sign-in after too many failures (``accounts.services``). The
Django admin's user forms ask for the email too and refuse one in use, as sign-up does."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import (
    AdminUserCreationForm,
    AuthenticationForm,
    PasswordResetForm,
    UserChangeForm,
    UserCreationForm,
)

from marketplace.accounts import services
from marketplace.accounts.errors import EmailTaken, TooManyLoginAttempts


class SignUpForm(UserCreationForm):
    email = forms.EmailField(required=True, help_text="For notices about your account; one account per address.")
    provider = forms.BooleanField(required=False, label="I provide GPUs (provider)")
    customer = forms.BooleanField(required=False, label="I buy inference (customer)")

    # The email is not a model field of this form, so the model's exact-case uniqueness check
    # does not run here: the service's check (without case) is the one rule, with one message.
    field_order = ["username", "email", "password1", "password2", "provider", "customer"]

    class Meta:
        model = get_user_model()
        fields = ("username",)


class ThrottledAuthenticationForm(AuthenticationForm):
    """Django's sign-in form, refusing a sign-in from an address past the failed sign-in limit
    (``throttled`` tells the view to answer 429) and counting each failure."""

    throttled = False

    def clean(self):
        username = self.cleaned_data.get("username") or ""
        address = self.request.META.get("REMOTE_ADDR", "") if self.request is not None else ""
        try:
            services.check_login_allowed(username, address)
        except TooManyLoginAttempts as exc:
            self.throttled = True
            raise forms.ValidationError(str(exc), code="throttled") from None
        try:
            cleaned = super().clean()
        except forms.ValidationError:
            if self.cleaned_data.get("password"):
                services.record_login_failure(username, address)
            raise
        services.clear_login_failures(username, address)
        return cleaned


class ThrottledPasswordResetForm(PasswordResetForm):
    """Django's password reset form (an email goes to the accounts of that address, if any; the page
    says the same either way), refusing an address past SWARM_PASSWORD_RESETS_PER_ADDRESS
    (``throttled`` tells the view to answer 429)."""

    throttled = False
    address = ""  # the client's, set by the view

    def clean(self):
        cleaned = super().clean()
        try:
            services.check_reset_allowed(self.address)
        except TooManyLoginAttempts as exc:
            self.throttled = True
            raise forms.ValidationError(str(exc), code="throttled") from None
        return cleaned


class EmailCheckMixin:
    """An admin user form's email: required, kept in lower case, and refused when another account
    uses it in any case (the model's own unique check compares exact case, so "Carol@x" would pass
    it; and Django's add form, which has no email field, saved a second user's blank address into
    the unique column: a 500)."""

    cleaned_data: dict[str, Any]  # the form's, which this is mixed into
    instance: Any

    def clean_email(self) -> str:
        try:
            return services.check_email_free(self.cleaned_data["email"], user_pk=self.instance.pk)
        except EmailTaken as exc:
            raise forms.ValidationError(str(exc), code=exc.code) from None


class AdminAddUserForm(EmailCheckMixin, AdminUserCreationForm):
    """The admin's "Add user" form: username, email, roles, and a password the validators accept."""

    class Meta(AdminUserCreationForm.Meta):
        model = get_user_model()
        fields = ("username", "email", "is_provider", "is_customer")


class AdminChangeUserForm(EmailCheckMixin, UserChangeForm):
    """The admin's user page: an email changed to one in use is refused on the form."""

    class Meta(UserChangeForm.Meta):
        model = get_user_model()
