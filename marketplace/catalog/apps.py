from django.apps import AppConfig
from django.conf import settings

from worker_agent import checkpoints


class CatalogConfig(AppConfig):
    name = "marketplace.catalog"
    label = "catalog"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Every process of the control plane (web, coordinators, verifier) resolves a catalog ref
        # to the checkpoint copied into the catalog's folder, whichever of them touches it first.
        checkpoints.add_store(settings.SWARM_CATALOG_DIR)
