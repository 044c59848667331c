"""Read queries of the catalog: which models the swarm serves, and what an assignment or a request
needs to know of one.

A served model is named, everywhere below the API (placement, jobs, tickets, receipts, prices'
lookups, metrics), by its *key*: a registry id, or a catalog entry's model ref ``name@<16 hex>``.
Customers ask for the catalog name (or the ref itself, to pin those exact weights);
``requested_model`` maps what they asked for to the key.
"""

from __future__ import annotations

from django.conf import settings
from django.urls import reverse

from marketplace.catalog.models import CatalogModel, SourceKind
from worker_agent import checkpoints


def is_path(model: str) -> bool:
    """Whether a SWARM_MODELS entry is a checkpoint folder's path rather than a model id."""
    return "/" in model or model.startswith("~")


def served_models() -> list[str]:
    """The keys of the models the swarm serves, in precedence order (ties in sharing the nodes go
    to the earlier): the ids SWARM_MODELS names, then each enabled catalog entry, oldest first. A
    SWARM_MODELS entry that is a checkpoint folder is served through the catalog entry it is
    registered as at start-up (``services.register_settings_checkpoints``), never by its path."""
    listed = [model for model in settings.SWARM_MODELS if not is_path(model)]
    entries = CatalogModel.objects.filter(enabled=True).only("name", "source_kind", "source", "content_hash")
    return list(dict.fromkeys(listed + [entry.ref for entry in entries.order_by("pk")]))


def entry_for(model: str) -> CatalogModel | None:
    """The catalog entry of a served key: the entry a ref names (its name and hash prefix), or the
    registry entry of a registry id; None when the catalog has none."""
    match = checkpoints.REF.fullmatch(model)
    if match is not None:
        return CatalogModel.objects.filter(name=match["name"], content_hash__startswith=match["prefix"]).first()
    return CatalogModel.objects.filter(name=model, source_kind=SourceKind.REGISTRY).first()


def requested_model(requested: str) -> str | None:
    """The key of the served model a request names, by key or by catalog name; None if none."""
    if requested in settings.SWARM_MODELS and not is_path(requested):
        return requested  # served by the settings: no catalog read on a request's way in
    served = served_models()
    if requested in served:
        return requested
    entry = CatalogModel.objects.filter(name=requested, enabled=True).first()
    return entry.ref if entry is not None and entry.ref in served else None


def min_reputation(model: str) -> float:
    """The reputation a node needs to be placed on ``model`` (0 for a model outside the catalog)."""
    entry = entry_for(model)
    return entry.min_reputation if entry is not None else 0.0


def manifest_path(ref: str) -> str:
    """Where agents read a checkpoint's manifest, relative to the control plane's URL."""
    return reverse("install:checkpoint-manifest", args=[ref]).lstrip("/")


def assignment_source(model: str) -> dict[str, str]:
    """What an assignment of ``model`` adds for the agent to fetch its files: the content hash and
    the manifest's URL of a catalog checkpoint; nothing for a registry model, which agents build."""
    if not checkpoints.is_ref(model):
        return {}
    entry = entry_for(model)
    if entry is None:
        return {}
    return {"content_hash": entry.content_hash, "source": manifest_path(entry.ref)}


def served_entry(ref: str) -> CatalogModel | None:
    """The enabled catalog entry whose files agents may fetch under ``ref``."""
    entry = entry_for(ref) if checkpoints.is_ref(ref) else None
    return entry if entry is not None and entry.enabled and entry.ref == ref else None
