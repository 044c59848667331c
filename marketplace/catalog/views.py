"""Catalog checkpoints' files for agents, public like the agent's install (``marketplace.install``):

- ``GET /install/models/<ref>/manifest.json``: the checkpoint's files with their sha256 and size,
  and its content hash (``worker_agent.checkpoints.content_hash`` over the files);
- ``GET /install/models/<ref>/<file>``: a file the manifest names, from the control plane's copy.

Only an enabled entry's files are served, and only under its current ref. An agent checks what
it gets against the content hash its assignment names (``worker_agent.fetch``), so these answers
need no trust of their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import Http404, HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.http import require_GET

from marketplace.catalog.models import CatalogModel
from marketplace.catalog.selectors import served_entry
from marketplace.db import release_connections

CHUNK_BYTES = 1 << 20
MANIFEST_VERSION = 1


def _served(ref: str) -> CatalogModel | None:
    # An async view's ORM call runs in a thread that Django's end-of-request cleanup never visits:
    # its connection goes back to the pool here, or each download would keep one.
    try:
        return served_entry(ref)
    finally:
        release_connections()


async def _entry(ref: str) -> CatalogModel:
    entry = await sync_to_async(_served)(ref)
    if entry is None:
        raise Http404("no such model in the catalog")
    return entry


@require_GET
async def manifest(request: HttpRequest, ref: str) -> JsonResponse:
    entry = await _entry(ref)
    return JsonResponse(
        {
            "version": MANIFEST_VERSION,
            "ref": entry.ref,
            "name": entry.name,
            "content_hash": entry.content_hash,
            "files": entry.files,
        }
    )


async def file_chunks(path: Path) -> AsyncIterator[bytes]:
    """A file's bytes in 1 MiB chunks, read off the event loop (the install's wheels use it too)."""
    handle = await asyncio.to_thread(open, path, "rb")
    try:
        while chunk := await asyncio.to_thread(handle.read, CHUNK_BYTES):
            yield chunk
    finally:
        handle.close()


@require_GET
async def checkpoint_file(request: HttpRequest, ref: str, name: str) -> StreamingHttpResponse:
    entry = await _entry(ref)
    listed = next((file for file in entry.files if file["path"] == name), None)
    if listed is None:
        raise Http404("no such file in the checkpoint")
    # Streamed from an async iterator: the ASGI handler would read a file response whole into memory.
    response = StreamingHttpResponse(file_chunks(Path(settings.SWARM_CATALOG_DIR) / entry.content_hash / name))
    response["Content-Type"] = "application/octet-stream"
    response["Content-Length"] = str(listed["size"])
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response
