"""Shared admin pieces: read-only model admins, and actions that ask for a reason before they apply."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.template.response import TemplateResponse

from marketplace.errors import DomainError

REFUSALS = (DomainError,)  # a service's refusal, shown to the admin; anything else is a bug


class ReadOnlyAdmin(admin.ModelAdmin):
    """Records that only services write (ledgers, checks, earnings): visible, never edited here."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class ReasonForm(forms.Form):
    reason = forms.CharField(widget=forms.Textarea(attrs={"rows": 3}), max_length=2000, strip=True)


def with_reason(modeladmin, request, queryset, *, title: str, apply):
    """Ask for a reason on an intermediate page, then apply the action to each selected row."""
    if "apply" in request.POST:
        form = ReasonForm(request.POST)
        if form.is_valid():
            done = 0
            for obj in queryset:
                try:
                    apply(obj, form.cleaned_data["reason"])
                    done += 1
                except REFUSALS as exc:
                    modeladmin.message_user(request, f"{obj}: {exc}", messages.ERROR)
            modeladmin.message_user(request, f"{title}: {done} done")
            return None
    else:
        form = ReasonForm()
    return TemplateResponse(
        request,
        "admin/reason_action.html",
        {
            **modeladmin.admin_site.each_context(request),
            "title": title,
            "form": form,
            "objects": queryset,
            "action": request.POST.get("action"),
            "selected": request.POST.getlist(ACTION_CHECKBOX_NAME),
            "opts": modeladmin.model._meta,
        },
    )
