"""What the marketplace offers: a catalog entry and its prices, registered or changed together.

Prices are dollars per million prompt and completion tokens here (``Decimal``, >= 0, to the
nano-dollar); billing keeps them as ``ModelPrice`` rows in nano-dollars, by catalog name, and
reads nothing else. The catalog sits below placement and billing (placement reads the served
models from it), so the steps that touch both live here, above them; the admin's pages and the
staff API call these. Placement follows an entry enabled or disabled here (``_follow``).
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from django.db import transaction

from marketplace.billing.models import NANO_PER_DOLLAR
from marketplace.billing.selectors import dollars
from marketplace.billing.services import prices_for, set_prices
from marketplace.catalog import services as catalog
from marketplace.catalog.errors import CatalogError
from marketplace.catalog.models import CatalogModel
from marketplace.catalog.selectors import served_models
from marketplace.placement.placing import stop_serving
from marketplace.placement.rebalancing import mark_dirty

Price = Decimal | str | int | None  # dollars per million tokens; None: left as it is
MAX_DOLLARS_PER_MILLION = Decimal(1_000_000)  # far above any price, far below the ledger's 64-bit nano-dollars


def nano_per_million(dollars_per_million: Decimal | str | int, param: str) -> int:
    """A price in dollars per million tokens as nano-dollars per million tokens."""
    try:
        value = Decimal(str(dollars_per_million))
        valid = (
            not isinstance(dollars_per_million, bool)
            and value.is_finite()
            and 0 <= value <= MAX_DOLLARS_PER_MILLION
            and value == value.quantize(Decimal("1e-9"))
        )
    except InvalidOperation:
        valid = False
    if not valid:
        raise CatalogError(
            f"{param} is dollars per million tokens, from 0 to {MAX_DOLLARS_PER_MILLION} with at most 9 "
            f"decimals; got {dollars_per_million!r}",
            param=param,
            code="catalog_invalid_price",
        )
    return int(value * NANO_PER_DOLLAR)


def prices(name: str) -> tuple[Decimal, Decimal]:
    """The (prompt, completion) dollars per million tokens in force for the model named ``name``."""
    prompt, completion = prices_for(name)
    return dollars(prompt), dollars(completion)


def _set_prices(name: str, prompt: Price, completion: Price) -> None:
    """Put the prices given in force (the one not given stays as it is)."""
    if prompt is None and completion is None:
        return
    current = prices_for(name)
    set_prices(
        name,
        current[0] if prompt is None else nano_per_million(prompt, "prompt_price"),
        current[1] if completion is None else nano_per_million(completion, "completion_price"),
    )


def register(
    name: str,
    source_kind: str,
    source: str,
    *,
    source_sha256: str = "",
    min_reputation: float = 0.0,
    enabled: bool = True,
    prompt_price: Price = None,
    completion_price: Price = None,
) -> CatalogModel:
    """Register a checkpoint in the catalog (``catalog.services``) with its prices; every input is
    checked before the checkpoint is read, and the entry and its prices are written together."""
    for value, param in ((prompt_price, "prompt_price"), (completion_price, "completion_price")):
        if value is not None:
            nano_per_million(value, param)
    catalog.check_reputation(min_reputation)
    acquired = catalog.acquire(name, source_kind, source, source_sha256)
    with transaction.atomic():
        entry = catalog.create_entry(
            name,
            source_kind,
            source,
            acquired,
            source_sha256=source_sha256,
            min_reputation=min_reputation,
            enabled=enabled,
        )
        _set_prices(entry.name, prompt_price, completion_price)
        _follow(entry)
    return entry


@transaction.atomic
def update(
    name: str,
    *,
    enabled: bool | None = None,
    min_reputation: float | None = None,
    prompt_price: Price = None,
    completion_price: Price = None,
) -> CatalogModel:
    """Enable or disable an entry, change the reputation its nodes need, or its prices."""
    was_enabled = catalog.get_entry(name).enabled
    entry = catalog.update_entry(name, enabled=enabled, min_reputation=min_reputation)
    _set_prices(entry.name, prompt_price, completion_price)
    if entry.enabled != was_enabled:
        _follow(entry)
    return entry


def _follow(entry: CatalogModel) -> None:
    """Placement follows: a model now served is placed at the next sweep, once this commits; one no
    longer served (SWARM_MODELS may still serve a registry model) has its blocks released."""
    if entry.ref in served_models():
        transaction.on_commit(lambda: mark_dirty(entry.ref))
    else:
        stop_serving(entry.ref)
