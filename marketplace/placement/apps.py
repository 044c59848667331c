from django.apps import AppConfig


class PlacementConfig(AppConfig):
    name = "marketplace.placement"
    label = "placement"
    default_auto_field = "django.db.models.BigAutoField"
