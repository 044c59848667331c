"""The agent's install over HTTP, public (nothing here is secret: the join token never is in it).

- ``GET /install/agent.sh``: the install script (``script.py``), naming this control plane;
- ``GET /install/manifest.json``: the served wheels, each with its sha256 and size;
- ``GET /install/wheels/<file>``: a wheel the manifest names;
- ``GET /install/models/<ref>/manifest.json``: a catalog checkpoint's files with their sha256 and
  size, and its content hash (``worker_agent.checkpoints.content_hash`` over the files);
- ``GET /install/models/<ref>/<file>``: a file the checkpoint's manifest names, from the control
  plane's copy.

The first request for the wheels builds them if they are missing or stale (``services.ensure_wheels``):
the views are async and do that in a worker thread, so that the rest of the site is not held meanwhile.
Only an enabled catalog entry's files are served, and only under its current ref. An agent checks
what it gets against the content hash its assignment names (``worker_agent.agent.fetch``), so these
answers need no trust of their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.http import require_GET

from marketplace.catalog.models import CatalogModel
from marketplace.catalog.selectors import served_entry
from marketplace.db import release_connections
from marketplace.install import services
from marketplace.install.errors import WheelsUnavailable
from marketplace.install.script import public_url, render_script

CHUNK_BYTES = 1 << 20
CHECKPOINT_MANIFEST_VERSION = 1


async def _manifest() -> dict[str, Any]:
    return await asyncio.to_thread(services.ensure_wheels)


def _unavailable(exc: WheelsUnavailable) -> HttpResponse:
    return HttpResponse(
        f"the agent's install is not available: {exc.message}\n", status=503, content_type="text/plain; charset=utf-8"
    )


@require_GET
async def agent_script(request: HttpRequest) -> HttpResponse:
    try:
        manifest = await _manifest()
    except WheelsUnavailable as exc:
        return _unavailable(exc)
    response = HttpResponse(render_script(public_url(request), manifest), content_type="text/x-shellscript")
    response["Cache-Control"] = "no-cache"  # it names the current wheels' digests
    return response


@require_GET
async def manifest(request: HttpRequest) -> HttpResponse:
    try:
        body = await _manifest()
    except WheelsUnavailable as exc:
        return _unavailable(exc)
    response = JsonResponse(body)
    response["Cache-Control"] = "no-cache"
    return response


@require_GET
async def wheel(request: HttpRequest, name: str) -> HttpResponse | StreamingHttpResponse:
    try:
        entry = services.served_file(await _manifest(), name)
    except WheelsUnavailable as exc:
        return _unavailable(exc)
    if entry is None:
        raise Http404("no such wheel")
    # Streamed from an async iterator: the ASGI handler would read a file response whole into memory.
    response = StreamingHttpResponse(file_chunks(Path(settings.SWARM_WHEELS_DIR) / entry.name))
    response["Content-Type"] = "application/octet-stream"
    response["Content-Length"] = str(entry.size)
    response["Content-Disposition"] = f'attachment; filename="{entry.name}"'
    response["Cache-Control"] = "no-cache"  # the agent's wheel keeps its name when rebuilt
    return response


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
async def checkpoint_manifest(request: HttpRequest, ref: str) -> JsonResponse:
    entry = await _entry(ref)
    return JsonResponse(
        {
            "version": CHECKPOINT_MANIFEST_VERSION,
            "ref": entry.ref,
            "name": entry.name,
            "content_hash": entry.content_hash,
            "files": entry.files,
        }
    )


async def file_chunks(path: Path) -> AsyncIterator[bytes]:
    """A file's bytes in 1 MiB chunks, read off the event loop (a wheel's or a checkpoint's)."""
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
