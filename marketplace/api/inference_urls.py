"""The inference API's URLs (OpenAI's paths, at the root), and the URL conf of the handler that
serves them alone in the ASGI app (``marketplace.asgi.InferenceHandler``): every answer under
``/v1`` is JSON in OpenAI's error shape, an unknown path and a server error included, never the
dashboards' HTML pages."""

from django.urls import path, re_path

from marketplace.api import openai

urlpatterns = [
    path("v1/models", openai.list_models, name="v1-models"),
    path("v1/chat/completions", openai.chat_completions, name="v1-chat-completions"),
    path("v1/completions", openai.completions, name="v1-completions"),
    re_path(r"^v1(?:/.*)?$", openai.unknown_url, name="v1-unknown"),
]

handler404 = "marketplace.api.openai.unknown_url"
handler500 = "marketplace.api.openai.server_error"
