from django.apps import AppConfig


class InstallConfig(AppConfig):
    name = "marketplace.install"
    label = "install"
    default_auto_field = "django.db.models.BigAutoField"
