"""Error codes of the catalog: why a checkpoint was not registered, or an entry not changed.

catalog_invalid_name        the name is not 1-64 of [a-z0-9._-], starting with a letter or digit
catalog_name_taken          another entry has that name
catalog_invalid_source      the source does not fit its kind (no such registry id, not a folder, not a URL)
catalog_missing_sha256      a URL source came without the archive's sha256
catalog_source_unavailable  the archive could not be fetched
catalog_checksum_mismatch   the fetched archive's sha256 is not the one given
catalog_bad_archive         the archive is not a .tar/.tar.gz of one checkpoint folder
catalog_missing_config      the checkpoint has no readable config.json
catalog_unsupported_architecture  its model_type is not one the layer block computes
catalog_unreadable_safetensors    a weight file's header cannot be read, or layers are missing
catalog_invalid_price       a price is not a dollar amount >= 0 with at most 9 decimals
catalog_not_found           no entry has that name
"""

from __future__ import annotations

from marketplace.errors import DomainError


class CatalogError(DomainError):
    code = "catalog_invalid"


class CatalogNotFound(CatalogError):
    code = "catalog_not_found"
