from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from marketplace.api import views

router = DefaultRouter()
router.register("nodes", views.NodeViewSet, basename="node")
router.register("keys", views.ApiKeyViewSet, basename="key")

urlpatterns = [
    path("v1/", include(router.urls)),
    path("v1/agents/register", views.register_agent, name="agent-register"),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
]
