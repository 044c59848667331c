from django.contrib import admin
from django.contrib.auth.admin import UserAdmin

from marketplace.accounts.models import User


@admin.register(User)
class SwarmUserAdmin(UserAdmin):
    fieldsets = (*UserAdmin.fieldsets, ("Roles", {"fields": ("is_provider", "is_customer")}))
    list_display = ("username", "email", "is_provider", "is_customer", "is_staff")
