"""Where a catalog checkpoint's files come from, and the copy of them the control plane keeps.

- ``registry``: every agent builds the model itself (``worker_agent.model.REGISTRY``); the control
  plane describes and hashes its own build.
- ``directory``: a folder on the control plane's host (an absolute path). Its checkpoint files are
  copied into ``SWARM_CATALOG_DIR/<content hash>/``.
- ``url``: an ``http(s)`` URL of a ``.tar`` or ``.tar.gz`` archive of one checkpoint folder, fetched
  once (at most SWARM_CATALOG_MAX_ARCHIVE_BYTES, each read within SWARM_CATALOG_FETCH_TIMEOUT_S),
  checked against the sha256 given with it, and extracted there (links, absolute paths and paths
  out of the folder refused: ``tarfile``'s ``data`` filter).

The kept copy is what is hashed, what the coordinators and the verifier load, and what agents
download: a source folder changed after registration changes nothing that was registered.
"""

from __future__ import annotations

import hashlib
import http.client
import re
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from marketplace.catalog.checkpoint import Description, describe
from marketplace.catalog.errors import CatalogError
from marketplace.catalog.models import SourceKind
from worker_agent import checkpoints
from worker_agent.checkpoints import FileEntry

CHUNK_BYTES = 1 << 20
ARCHIVE_URL = re.compile(r"https?://[^\s]+", re.IGNORECASE)


@dataclass(frozen=True)
class Acquired:
    """A registered checkpoint's files as the control plane keeps them."""

    folder: Path  # what the control plane loads and serves
    files: list[FileEntry]
    content_hash: str
    description: Description


def _refuse(message: str, code: str, param: str = "source") -> CatalogError:
    return CatalogError(message, param=param, code=code)


def acquire(kind: str, source: str, source_sha256: str = "") -> Acquired:
    """The checkpoint ``source`` of ``kind`` described, hashed and kept; CatalogError when it
    cannot be served (``checkpoint.describe``) or fetched."""
    if kind == SourceKind.REGISTRY:
        return _registry(source)
    if kind == SourceKind.DIRECTORY:
        return _directory(source)
    if kind == SourceKind.URL:
        return _archive(source, source_sha256)
    raise _refuse(f"source_kind must be one of {', '.join(SourceKind.values)}, got {kind!r}", "catalog_invalid_source")


def _registry(source: str) -> Acquired:
    # torch and transformers: loaded only when a registry model is registered, which builds it.
    from worker_agent import model as models

    if source not in models.REGISTRY:
        known = ", ".join(sorted(models.REGISTRY))
        raise _refuse(f"{source!r} is not a registry model; use one of {known}", "catalog_invalid_source")
    folder = models.resolve_checkpoint(source)
    description = describe(folder)
    files = checkpoints.manifest_entries(folder)
    return Acquired(folder, files, checkpoints.content_hash(files), description)


def _directory(source: str) -> Acquired:
    folder = Path(source)
    if not folder.is_absolute():
        raise _refuse(
            f"a directory source is an absolute path on the control plane's host, got {source!r}",
            "catalog_invalid_source",
        )
    if not folder.is_dir():
        raise _refuse(f"{source} is not a directory on the control plane's host", "catalog_invalid_source")
    description = describe(folder)  # refused before a byte is copied
    return _keep(folder, description, shutil.copy2)


def _keep(folder: Path, description: Description, put: Callable[[Path, Path], object]) -> Acquired:
    """The checkpoint files of ``folder`` put (copied or moved) into a folder of their own in the
    catalog's directory, hashed there, and named by their content hash."""
    root = Path(settings.SWARM_CATALOG_DIR)
    root.mkdir(parents=True, exist_ok=True)
    checkpoints.add_store(root)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
    try:
        for name in checkpoints.checkpoint_file_names(folder):
            put(folder / name, staging / name)
        files = checkpoints.manifest_entries(staging)
        digest = checkpoints.content_hash(files)
        target = root / digest
        if not target.is_dir():  # the same weights kept already (under another name) are shared
            staging.rename(target)
        return Acquired(target, files, digest, description)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _archive(url: str, sha256: str) -> Acquired:
    if not ARCHIVE_URL.fullmatch(url):
        raise _refuse(
            f"a url source is an http(s) URL of a .tar or .tar.gz archive, got {url!r}", "catalog_invalid_source"
        )
    if not checkpoints.SHA256_HEX.fullmatch(sha256 or ""):
        raise _refuse(
            "a url source needs the archive's sha256 (64 lowercase hex digits)",
            "catalog_missing_sha256",
            "source_sha256",
        )
    root = Path(settings.SWARM_CATALOG_DIR)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
        archive = Path(tmp) / "archive"
        found = _download(url, archive)
        if found != sha256:
            raise _refuse(
                f"the archive at {url} has sha256 {found}, not {sha256}", "catalog_checksum_mismatch", "source_sha256"
            )
        folder = _extract(archive, Path(tmp) / "extracted")
        return _keep(folder, describe(folder), shutil.move)


def _download(url: str, path: Path) -> str:
    """Fetch ``url`` into ``path``; its sha256."""
    limit = settings.SWARM_CATALOG_MAX_ARCHIVE_BYTES
    digest, size = hashlib.sha256(), 0
    try:
        with (
            urllib.request.urlopen(url, timeout=settings.SWARM_CATALOG_FETCH_TIMEOUT_S) as response,
            open(path, "wb") as out,
        ):
            while chunk := response.read(CHUNK_BYTES):
                size += len(chunk)
                if size > limit:
                    message = f"the archive at {url} is larger than {limit} bytes (SWARM_CATALOG_MAX_ARCHIVE_BYTES)"
                    raise _refuse(message, "catalog_source_unavailable")
                digest.update(chunk)
                out.write(chunk)
    except urllib.error.HTTPError as exc:
        raise _refuse(f"{url} answered {exc.code} {exc.reason}", "catalog_source_unavailable") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _refuse(f"cannot fetch {url}: {getattr(exc, 'reason', exc)}", "catalog_source_unavailable") from None
    return digest.hexdigest()


def _extract(archive: Path, into: Path) -> Path:
    """The checkpoint folder of a .tar/.tar.gz: its root, or the one folder at its root."""
    limit = settings.SWARM_CATALOG_MAX_ARCHIVE_BYTES
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            if sum(member.size for member in members) > limit:
                raise _refuse(f"the archive unpacks to more than {limit} bytes", "catalog_bad_archive")
            tar.extractall(into, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise _refuse(f"the source is not a readable .tar or .tar.gz archive: {exc}", "catalog_bad_archive") from None
    if (into / "config.json").is_file():
        return into
    folders = [path for path in into.iterdir() if path.is_dir()]
    if len(folders) == 1 and (folders[0] / "config.json").is_file():
        return folders[0]
    raise _refuse(
        "the archive holds no checkpoint folder (config.json at its root or in its one folder)", "catalog_bad_archive"
    )
