"""Sign-up, sign-in and sign-out pages, under the ``accounts`` URL namespace."""

from django.contrib.auth import views as auth_views
from django.urls import path

from marketplace.web import account_views
from marketplace.web.views import home

app_name = "accounts"

urlpatterns = [
    path("signup/", account_views.sign_up, name="signup"),
    path("login/", account_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("password-reset/", account_views.PasswordResetView.as_view(), name="password_reset"),
    path(
        "password-reset/sent/",
        auth_views.PasswordResetDoneView.as_view(template_name="accounts/password_reset_done.html"),
        name="password_reset_done",
    ),
    path("reset/<uidb64>/<token>/", account_views.PasswordResetConfirmView.as_view(), name="password_reset_confirm"),
    path(
        "reset/done/",
        auth_views.PasswordResetCompleteView.as_view(template_name="accounts/password_reset_complete.html"),
        name="password_reset_complete",
    ),
    # The dashboard home (per-role overview) lives with the dashboards; sign-in lands on it.
    path("", home, name="home"),
]
