from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from marketplace.api import billing_views, catalog_views, views

router = DefaultRouter()
router.register("nodes", views.NodeViewSet, basename="node")
router.register("keys", views.ApiKeyViewSet, basename="key")
router.register("catalog", catalog_views.CatalogViewSet, basename="catalog")

urlpatterns = [
    path("v1/", include(router.urls)),
    path("v1/agents/register", views.register_agent, name="agent-register"),
    path("v1/agents/check-token", views.check_join_token, name="agent-check-token"),
    path("v1/credits", billing_views.credits, name="credits"),
    path("v1/generation", billing_views.generation, name="generation"),
    path("v1/billing/balance", billing_views.balance, name="billing-balance"),
    path("v1/billing/transactions", billing_views.transactions, name="billing-transactions"),
    path("v1/billing/usage", billing_views.usage, name="billing-usage"),
    path("v1/billing/usage.csv", billing_views.usage_csv, name="billing-usage-csv"),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
]
