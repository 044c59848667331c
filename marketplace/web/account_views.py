"""Sign-up and sign-in pages: the forms check the inputs, the accounts service applies the
account rules (roles, email, password validators, the failed sign-in limit)."""

from __future__ import annotations

from django.contrib.auth import login
from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from marketplace.accounts import services
from marketplace.accounts.errors import AccountError
from marketplace.accounts.forms import SignUpForm, ThrottledAuthenticationForm

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
