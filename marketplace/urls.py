from django.contrib import admin
from django.urls import include, path

from marketplace.api import openai
from marketplace.monitoring import views as monitoring

urlpatterns = [
    path("v1/models", openai.list_models, name="v1-models"),
    path("v1/chat/completions", openai.chat_completions, name="v1-chat-completions"),
    path("v1/completions", openai.completions, name="v1-completions"),
    path("admin/", admin.site.urls),
    path("api/", include("marketplace.api.urls")),
    path("", include("marketplace.api.stripe_urls")),
    path("healthz", monitoring.healthz, name="health"),
    path("readyz", monitoring.readyz, name="ready"),
    path("metrics", monitoring.metrics_view, name="metrics"),
    path("", include("marketplace.install.urls")),
    path("", include("marketplace.web.account_urls")),
    path("", include("marketplace.web.urls")),
]
