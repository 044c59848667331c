from django.contrib import admin
from django.http import JsonResponse
from django.urls import include, path


def health(request):
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("marketplace.api.urls")),
    path("healthz", health, name="health"),
    path("", include("marketplace.accounts.urls")),
]
