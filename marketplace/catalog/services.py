"""Catalog use cases: register a checkpoint, enable or disable an entry, set the reputation its
nodes need, and register the checkpoint folders SWARM_MODELS names at start-up.

Registration reads and copies the checkpoint (``sources.acquire``: seconds to minutes for a large
one) before the entry's row is written, outside any transaction. An entry's name and weights are
fixed once registered: new weights are a new entry. Enabling or disabling an entry changes what
``selectors.served_models`` returns; the placement sweep places a newly served model and releases
the blocks of one no longer served. Prices are set with these from ``marketplace.flows.offerings``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction

from marketplace.catalog import sources
from marketplace.catalog.errors import CatalogError, CatalogNotFound
from marketplace.catalog.models import CatalogModel, SourceKind
from marketplace.catalog.selectors import is_path
from worker_agent import checkpoints

log = logging.getLogger("swarm.catalog")


def check_name(name: object) -> str:
    if not isinstance(name, str) or not checkpoints.NAME.fullmatch(name):
        raise CatalogError(
            f"a catalog name is 1 to 64 of a-z, 0-9, '.', '_' and '-', starting with a letter or digit; got {name!r}",
            param="name",
            code="catalog_invalid_name",
        )
    if CatalogModel.objects.filter(name=name).exists():
        raise CatalogError(f"the catalog already has a model named {name!r}", param="name", code="catalog_name_taken")
    return name


def check_reputation(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise CatalogError(
            f"min_reputation must be a number from 0 to 1, got {value!r}",
            param="min_reputation",
            code="catalog_invalid",
        )
    return float(value)


def acquire(name: str, source_kind: str, source: str, source_sha256: str = "") -> sources.Acquired:
    """Check a registration's name and read, copy and hash its checkpoint (no row written)."""
    check_name(name)
    if source_kind == SourceKind.REGISTRY and name != source:
        raise CatalogError(
            f"a registry model is registered under its registry id: name it {source!r}, not {name!r}",
            param="name",
            code="catalog_invalid_name",
        )
    if source_kind != SourceKind.REGISTRY and name in settings.SWARM_MODELS:
        raise CatalogError(f"{name!r} is a model SWARM_MODELS serves already", param="name", code="catalog_name_taken")
    return sources.acquire(source_kind, source, source_sha256)


@transaction.atomic
def create_entry(
    name: str,
    source_kind: str,
    source: str,
    acquired: sources.Acquired,
    *,
    source_sha256: str = "",
    min_reputation: float = 0.0,
    enabled: bool = True,
) -> CatalogModel:
    """The entry's row, for a checkpoint ``acquire`` read; a name taken meanwhile is refused."""
    described = acquired.description
    try:
        with transaction.atomic():
            entry = CatalogModel.objects.create(
                name=name,
                source_kind=source_kind,
                source=source,
                source_sha256=source_sha256 if source_kind == SourceKind.URL else "",
                content_hash=acquired.content_hash,
                files=[file.to_json() for file in acquired.files],
                architecture=described.architecture,
                n_layers=described.n_layers,
                context_length=described.context_length,
                dtype=described.dtype,
                bytes_per_layer=described.bytes_per_layer,
                min_reputation=check_reputation(min_reputation),
                enabled=bool(enabled),
            )
    except IntegrityError:
        raise CatalogError(
            f"the catalog already has a model named {name!r}", param="name", code="catalog_name_taken"
        ) from None
    log.info("catalog: registered %s from %s %s (%d layers)", entry.ref, source_kind, source, described.n_layers)
    return entry


def register_model(
    name: str,
    source_kind: str,
    source: str,
    *,
    source_sha256: str = "",
    min_reputation: float = 0.0,
    enabled: bool = True,
) -> CatalogModel:
    """Register a checkpoint under ``name`` (see the module docstring); CatalogError says why not."""
    check_reputation(min_reputation)
    acquired = acquire(name, source_kind, source, source_sha256)
    return create_entry(
        name, source_kind, source, acquired, source_sha256=source_sha256, min_reputation=min_reputation, enabled=enabled
    )


def get_entry(name: str, *, lock: bool = False) -> CatalogModel:
    query = CatalogModel.objects.select_for_update() if lock else CatalogModel.objects
    entry = query.filter(name=name).first()
    if entry is None:
        raise CatalogNotFound(f"the catalog has no model named {name!r}", param="name")
    return entry


@transaction.atomic
def update_entry(name: str, *, enabled: bool | None = None, min_reputation: float | None = None) -> CatalogModel:
    """Enable or disable an entry, or change the reputation its nodes need."""
    entry = get_entry(name, lock=True)
    if enabled is not None:
        entry.enabled = bool(enabled)
    if min_reputation is not None:
        entry.min_reputation = check_reputation(min_reputation)
    entry.save(update_fields=["enabled", "min_reputation", "updated_at"])
    return entry


def settings_name(folder: str) -> str:
    """The catalog name of a SWARM_MODELS checkpoint folder: its own name, lowercased, with any
    character a name may not hold made a '-'."""
    name = re.sub(r"[^a-z0-9._-]", "-", Path(folder).expanduser().name.lower()).lstrip("._-")
    return name[:64] or "checkpoint"


def register_settings_checkpoints() -> list[str]:
    """Register each checkpoint folder SWARM_MODELS names that the catalog does not hold yet,
    under its folder's name; returns the refs registered. A folder whose name an entry of another
    source holds, or that cannot be served, is logged and left out: it is then not served."""
    registered = []
    for model in settings.SWARM_MODELS:
        if not is_path(model):
            continue
        source, name = str(Path(model).expanduser().resolve()), settings_name(model)
        held = CatalogModel.objects.filter(name=name).first()
        if held is not None:
            if (held.source_kind, held.source) != (SourceKind.DIRECTORY, source):
                log.warning("SWARM_MODELS %s: the catalog's %r comes from %s; not served", model, name, held.source)
            continue
        try:
            registered.append(register_model(name, str(SourceKind.DIRECTORY), source).ref)
        except CatalogError as exc:
            log.warning("SWARM_MODELS %s: not registered in the catalog: %s", model, exc)
    return registered
