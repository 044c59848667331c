"""Admin: jobs, read only; unverified ones are flagged with the reason and paid to nobody."""

from __future__ import annotations

from django.contrib import admin

from marketplace.jobs.models import Job


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("public_id", "customer", "model", "state", "completion_tokens", "charged_amount", "verified")
    list_filter = ("verified", "state", "model")
    search_fields = ("public_id",)
    exclude = ("transcripts",)

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Job._meta.fields if f.name != "transcripts"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
