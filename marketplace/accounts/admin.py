from django.contrib import admin
from django.contrib.auth.admin import UserAdmin

from marketplace.accounts.forms import AdminAddUserForm, AdminChangeUserForm
from marketplace.accounts.models import User


@admin.register(User)
class SwarmUserAdmin(UserAdmin):
    form = AdminChangeUserForm
    add_form = AdminAddUserForm
    fieldsets = (*(UserAdmin.fieldsets or ()), ("Roles", {"fields": ("is_provider", "is_customer")}))
    add_fieldsets = (
        (
            None,
            {"classes": ("wide",), "fields": ("username", "email", "usable_password", "password1", "password2")},
        ),
        ("Roles", {"fields": ("is_provider", "is_customer")}),
    )
    list_display = ("username", "email", "is_provider", "is_customer", "is_staff")
