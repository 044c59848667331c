"""The agent's install over HTTP, public (nothing here is secret: the join token never is in it).

- ``GET /install/agent.sh``: the install script (``script.py``), naming this control plane;
- ``GET /install/manifest.json``: the served wheels, each with its sha256 and size;
- ``GET /install/wheels/<file>``: a wheel the manifest names.

The first request builds the wheels if they are missing or stale (``services.ensure_wheels``): the
views are async and do that in a worker thread, so that the rest of the site is not held meanwhile.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.http import require_GET

from marketplace.catalog.views import file_chunks
from marketplace.install import services
from marketplace.install.errors import WheelsUnavailable
from marketplace.install.script import public_url, render_script


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
