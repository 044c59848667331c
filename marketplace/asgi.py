"""ASGI entry point: HTTP (Django: the inference API's paths under /v1 through a handler of their
own, ``InferenceHandler``; the rest, and /static/ unless SWARM_SERVE_STATIC=0), WebSockets
(Channels), and lifespan.

On lifespan startup the models' configs and tokenizers are loaded before the process takes
requests (a burst right after a start would otherwise find each request tokenizing on a cold
tokenizer). In the embedded default (no Redis), the periodic work (``marketplace.periodic``)
runs as a task of this process; in production Celery beat runs the same table.

    uvicorn marketplace.asgi:application --port 8000
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")

from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler

django_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.db import DatabaseError  # noqa: E402

from marketplace.catalog.selectors import served_models  # noqa: E402
from marketplace.catalog.services import register_settings_checkpoints  # noqa: E402
from marketplace.db import release_connections  # noqa: E402
from marketplace.periodic import embedded_scheduler  # noqa: E402
from marketplace.placement.rebalancing import mark_dirty  # noqa: E402
from marketplace.routing import websocket_urlpatterns  # noqa: E402
from worker_agent import heap  # noqa: E402

log = logging.getLogger("swarm.scheduler")
SCHEDULER_STOP_S = 60.0  # how long shutdown waits for the periodic entry running then

INFERENCE_URLCONF = "marketplace.api.inference_urls"


class InferenceHandler(ASGIHandler):
    """Django for the inference API's paths (``/v1`` and under): its own URL conf, whose every
    answer is JSON, and only ``INFERENCE_MIDDLEWARE``. The dashboards' sessions, CSRF, login and
    messages have nothing to do on a request authenticated by its bearer key, and each would pass
    it to a thread and back on its way in and out, on the path to the first token."""

    def load_middleware(self, is_async: bool = False) -> None:
        # Django builds the chain from settings.MIDDLEWARE alone: it reads the inference list
        # instead, once, while the app is built (before it serves anything).
        dashboards = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.INFERENCE_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = dashboards

    async def get_response_async(self, request):
        request.urlconf = INFERENCE_URLCONF
        return await super().get_response_async(request)


inference_app = InferenceHandler()
# Static files (the dashboards' CSS and JS, htmx, the API docs' assets) come from this app itself
# unless a proxy serves them: Django's own handler reads them through the staticfiles finders,
# with Last-Modified and If-Modified-Since, whatever DEBUG says.
dashboards_app = ASGIStaticFilesHandler(django_app) if settings.SWARM_SERVE_STATIC else django_app


async def http_app(scope, receive, send):
    path = scope["path"]
    app = inference_app if path == "/v1" or path.startswith("/v1/") else dashboards_app
    await app(scope, receive, send)


router = ProtocolTypeRouter({"http": http_app, "websocket": URLRouter(websocket_urlpatterns)})


def warm_models() -> None:
    """Register the checkpoint folders SWARM_MODELS names in the catalog (``catalog.services``;
    placed at the next sweep), then load each served model's config and tokenizer into this
    process's caches; a model that cannot load is logged and left to fail its requests with the
    loader's own message."""
    from worker_agent import model as models  # torch and transformers: loaded when the app starts, not on import

    models.set_threads(settings.SWARM_TORCH_THREADS)
    try:
        for ref in register_settings_checkpoints():
            mark_dirty(ref)
        served = served_models()
    except DatabaseError as exc:  # not migrated yet: each model loads at its first request instead
        log.warning("the catalog cannot be read: %s; no model preloaded", exc)
        served = []
    finally:
        release_connections()  # this worker thread's: the pool's connection is not kept by a thread that is done
    for model in served:
        try:
            models.load_config(model)
            models.load_tokenizer(model)
        except Exception as exc:  # a broken checkpoint must not keep the other models from serving
            log.warning("model %s: not preloaded: %s", model, exc)
    for urlconf in (settings.ROOT_URLCONF, INFERENCE_URLCONF):
        importlib.import_module(urlconf)  # and so every view: now, not at the first request
    if settings.SWARM_FREEZE_HEAP:
        heap.settle()  # what the process keeps for good is loaded: no full collection walks it again


async def application(scope, receive, send):
    if scope["type"] != "lifespan":
        await router(scope, receive, send)
        return
    task, stop = None, asyncio.Event()
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await asyncio.to_thread(warm_models)
            if settings.SWARM_EMBEDDED_SCHEDULER:
                task = asyncio.create_task(embedded_scheduler(settings.SWARM_SWEEP_INTERVAL_S, stop))
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if task is not None:
                stop.set()  # the entry running now ends first (see embedded_scheduler)
                try:
                    await asyncio.wait_for(asyncio.shield(task), SCHEDULER_STOP_S)
                except TimeoutError:
                    log.warning("the embedded scheduler did not stop within %gs: cancelled", SCHEDULER_STOP_S)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await send({"type": "lifespan.shutdown.complete"})
            return
