from channels.auth import AuthMiddlewareStack
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from marketplace.api.agent_channel import AgentControlConsumer
from marketplace.web.consumers import DashboardConsumer

websocket_urlpatterns = [
    path("ws/agent/", AgentControlConsumer.as_asgi()),
    # The browser's session cookie signs it in; the Origin check keeps other sites' pages from
    # opening it with that cookie.
    path("ws/dashboard/", AllowedHostsOriginValidator(AuthMiddlewareStack(DashboardConsumer.as_asgi()))),
]
