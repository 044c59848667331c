"""Admin: nodes, with eject (a reason is required), reinstate, and trust marks (a reason is required)."""

from __future__ import annotations

from django.contrib import admin, messages

from marketplace.admin_actions import with_reason
from marketplace.nodes.errors import NodeError
from marketplace.nodes.models import Node
from marketplace.nodes.services import reinstate_node
from marketplace.placement.lifecycle import eject_node, set_trusted


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "owner", "node_id", "state", "region", "reputation", "connected", "trusted_at")
    list_filter = ("state", "region", ("trusted_at", admin.EmptyFieldListFilter))
    search_fields = ("name", "node_id", "owner__username")
    readonly_fields = [f.name for f in Node._meta.fields if f.name not in ("name", "region", "max_layers")]
    actions = ["eject", "reinstate", "mark_trusted", "clear_trusted"]

    def has_add_permission(self, request):
        return False

    @admin.action(description="Eject (a reason is required)")
    def eject(self, request, queryset):
        return with_reason(
            self,
            request,
            queryset,
            title="Eject nodes",
            apply=lambda node, reason: eject_node(node, reason=reason, by=request.user),
        )

    @admin.action(description="Reinstate ejected nodes")
    def reinstate(self, request, queryset):
        done = 0
        for node in queryset:
            try:
                reinstate_node(node, by=request.user)
                done += 1
            except NodeError as exc:
                self.message_user(request, f"{node}: {exc}", messages.ERROR)
        self.message_user(request, f"Reinstated {done} node(s)")

    @admin.action(description="Mark trusted (vetted; a reason is required)")
    def mark_trusted(self, request, queryset):
        return with_reason(
            self,
            request,
            queryset,
            title="Mark nodes trusted",
            apply=lambda node, reason: set_trusted(node, True, by=request.user, reason=reason),
        )

    @admin.action(description="Clear the trust mark (a reason is required)")
    def clear_trusted(self, request, queryset):
        return with_reason(
            self,
            request,
            queryset,
            title="Clear trust marks",
            apply=lambda node, reason: set_trusted(node, False, by=request.user, reason=reason),
        )
