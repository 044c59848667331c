"""Sign-up page: the form checks the inputs, the accounts service applies the account rules."""

from __future__ import annotations

from django.contrib.auth import login
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from marketplace.accounts import services
from marketplace.accounts.errors import AccountError
from marketplace.accounts.forms import SignUpForm


@require_http_methods(["GET", "POST"])
def sign_up(request: HttpRequest) -> HttpResponse:
    form = SignUpForm(request.POST or None)
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
            form.add_error(exc.param, str(exc))
        else:
            login(request, user, backend="django.contrib.auth.backends.ModelBackend")
            return redirect("accounts:home")
    return render(request, "accounts/signup.html", {"form": form}, status=400 if form.errors else 200)
