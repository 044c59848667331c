from django.urls import path

from marketplace.nodes.consumers import AgentControlConsumer

websocket_urlpatterns = [
    path("ws/agent/", AgentControlConsumer.as_asgi()),
]
