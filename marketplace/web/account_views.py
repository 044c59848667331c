"""Sign-up and sign-in pages: the forms check the inputs, the accounts service applies the
account rules (roles, email, password validators, the failed sign-in limit)."""

from __future__ import annotations

from django.contrib.auth import login
from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse_lazy
from django.views.decorators.http import require_http_methods

from marketplace.accounts import services
from marketplace.accounts.errors import AccountError
from marketplace.accounts.forms import SignUpForm, ThrottledAuthenticationForm, ThrottledPasswordResetForm
from marketplace.install.script import public_url

FIELD_OF_PARAM = {"password": "password1"}  # the service's input names, as this form calls them
ROLES = ("provider", "customer")  # the front door's buttons sign up with ``?as=<role>``: that box comes ticked


class LoginView(auth_views.LoginView):
    """Django's sign-in page; 429 when too many sign-ins failed from this address (the form says
    how long to wait)."""

    template_name = "accounts/login.html"
    form_class = ThrottledAuthenticationForm

    def form_invalid(self, form):
        response = super().form_invalid(form)
        if form.throttled:
            response.status_code = 429
        return response


class PasswordResetView(auth_views.PasswordResetView):
    """Django's password reset: a link that works once, for PASSWORD_RESET_TIMEOUT, mailed to the
    accounts of the address given (through SMTP, or to the web process's output where none is
    configured); the page says the same whether or not an account has that address. The link
    starts at SWARM_PUBLIC_URL, or the address the page was reached at. 429 past the limit of
    requests from one client address."""

    template_name = "accounts/password_reset_form.html"
    email_template_name = "accounts/password_reset_email.txt"
    subject_template_name = "accounts/password_reset_subject.txt"
    form_class = ThrottledPasswordResetForm
    success_url = reverse_lazy("accounts:password_reset_done")

    def get_form(self, form_class=None):
        form = super().get_form(form_class)
        form.address = self.request.META.get("REMOTE_ADDR", "")
        return form

    def form_valid(self, form):
        self.extra_email_context = {"base_url": public_url(self.request)}
        return super().form_valid(form)

    def form_invalid(self, form):
        response = super().form_invalid(form)
        response.status_code = 429 if form.throttled else 400
        return response


class PasswordResetConfirmView(auth_views.PasswordResetConfirmView):
    """The link's page: a new password (the same rules as at sign-up), then signed in."""

    template_name = "accounts/password_reset_confirm.html"
    success_url = reverse_lazy("accounts:password_reset_complete")
    post_reset_login = True
    post_reset_login_backend = "django.contrib.auth.backends.ModelBackend"


@require_http_methods(["GET", "POST"])
def sign_up(request: HttpRequest) -> HttpResponse:
    wanted = request.GET.get("as", "")
    form = SignUpForm(request.POST or None, initial={wanted: True} if wanted in ROLES else None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            user = services.sign_up(
                username=data["username"],
                email=data["email"],
                password=data["password1"],
                provider=data["provider"],
                customer=data["customer"],
            )
        except AccountError as exc:
            form.add_error(FIELD_OF_PARAM.get(exc.param or "", exc.param), str(exc))
        else:
            login(request, user, backend="django.contrib.auth.backends.ModelBackend")
            return redirect("accounts:home")
    return render(request, "accounts/signup.html", {"form": form}, status=400 if form.errors else 200)
