from django.urls import path

from marketplace.catalog import views

urlpatterns = [
    path("install/models/<str:ref>/manifest.json", views.manifest, name="catalog-manifest"),
    path("install/models/<str:ref>/<str:name>", views.checkpoint_file, name="catalog-file"),
]
