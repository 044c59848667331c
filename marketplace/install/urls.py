from django.urls import path

from marketplace.install import views

app_name = "install"

urlpatterns = [
    path("install/agent.sh", views.agent_script, name="agent-script"),
    path("install/manifest.json", views.manifest, name="manifest"),
    path("install/wheels/<str:name>", views.wheel, name="wheel"),
]
