from django.apps import AppConfig


class PayoutsConfig(AppConfig):
    name = "marketplace.payouts"
    label = "payouts"
    default_auto_field = "django.db.models.BigAutoField"
