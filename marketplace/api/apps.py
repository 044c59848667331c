from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "marketplace.api"
    label = "api"
