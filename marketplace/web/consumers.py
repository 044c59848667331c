"""The dashboards' live channel (``/ws/dashboard/``): a signed-in browser listens here for notices
that something it may show changed, and refetches the affected fragments over HTTP.

The channel carries notices only (``{"topic": "node", "node": 12}``), never data: what a user may
see is decided by the HTTP views, as for any page load. A user hears about their own nodes; staff
also hear about every node.
"""

from __future__ import annotations

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from marketplace.nodes.live import ADMIN_GROUP, user_group

CLOSE_UNAUTHORIZED = 4401


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    joined: tuple[str, ...] = ()

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_active:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        self.joined = (user_group(user.pk), ADMIN_GROUP) if user.is_staff else (user_group(user.pk),)
        for group in self.joined:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        for group in self.joined:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        """The browser only listens; anything it sends is ignored."""

    async def dashboard_event(self, event: dict) -> None:
        await self.send_json({"topic": event["topic"], "node": event.get("node")})
