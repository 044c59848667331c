from django.urls import path

from marketplace.install import views

app_name = "install"

urlpatterns = [
    path("install/agent.sh", views.agent_script, name="agent-script"),
    path("install/manifest.json", views.manifest, name="manifest"),
    path("install/wheels/<str:name>", views.wheel, name="wheel"),
    path("install/models/<str:ref>/manifest.json", views.checkpoint_manifest, name="checkpoint-manifest"),
    path("install/models/<str:ref>/<str:name>", views.checkpoint_file, name="checkpoint-file"),
]
