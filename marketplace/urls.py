from django.contrib import admin
from django.urls import include, path

from marketplace.monitoring import views as monitoring

urlpatterns = [
    path("", include("marketplace.api.inference_urls")),
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
