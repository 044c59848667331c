"""The model catalog: the checkpoints an admin registered for the swarm to serve.

Everything about a checkpoint but its name, source and the admin's choices (minimum reputation,
enabled) is read from the checkpoint itself at registration (``services.register_model``):
architecture, layer count, context length, dtype, bytes per layer, the file manifest and the
content hash over it. Prices are not kept here: they are ``billing.ModelPrice`` rows, by name.
"""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from worker_agent import checkpoints


class SourceKind(models.TextChoices):
    REGISTRY = "registry", "registry model"  # built by every agent itself (worker_agent.model.REGISTRY)
    DIRECTORY = "directory", "checkpoint directory"  # a folder on the control plane's host, copied at registration
    URL = "url", "archive URL"  # a .tar/.tar.gz fetched once at registration, checked by its sha256


# What describes an entry: what was registered and what was read from its checkpoint (the admin's
# read-only fields and the API's, with their own additions).
DESCRIBED_BY = (
    "name",
    "ref",
    "source_kind",
    "source",
    "source_sha256",
    "content_hash",
    "architecture",
    "n_layers",
    "context_length",
    "dtype",
    "bytes_per_layer",
)


class CatalogModel(models.Model):
    name = models.CharField(max_length=64, unique=True)  # what customers ask for; checkpoints.NAME
    source_kind = models.CharField(max_length=16, choices=SourceKind.choices)
    source = models.CharField(max_length=1024)  # the registry id, the directory path or the archive's URL
    source_sha256 = models.CharField(max_length=64, blank=True)  # of the fetched archive (url sources)
    content_hash = models.CharField(max_length=64)  # checkpoints.content_hash over ``files``
    files = models.JSONField(default=list)  # the manifest: [{path, sha256, size}], by path
    architecture = models.CharField(max_length=32)  # config.json's model_type
    n_layers = models.PositiveIntegerField()
    context_length = models.PositiveIntegerField(null=True, blank=True)  # max_position_embeddings, if set
    dtype = models.CharField(max_length=16)  # of the decoder layers' weights as stored
    bytes_per_layer = models.BigIntegerField()  # of decoder layer 0's weights as stored
    min_reputation = models.FloatField(default=0.0, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)])
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["pk"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(min_reputation__gte=0.0) & models.Q(min_reputation__lte=1.0),
                name="catalog_min_reputation_in_0_1",
            ),
        ]

    def __str__(self) -> str:
        return self.ref

    @property
    def ref(self) -> str:
        """What placement, tickets and receipts call it: ``name@<16 hex>``; a registry model,
        which every agent builds the same way, keeps its registry id."""
        if self.source_kind == SourceKind.REGISTRY:
            return self.source
        return checkpoints.model_ref(self.name, self.content_hash)
