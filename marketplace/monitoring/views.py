"""``/healthz`` (liveness), ``/readyz`` (readiness) and ``/metrics`` (Prometheus).

``/healthz`` answers at once without touching anything: agents time it to measure their RTT to
the control plane. ``/readyz`` checks the dependencies (``readiness``). ``/metrics`` shows business
figures (ledger totals, jobs): with SWARM_METRICS_TOKEN set it wants ``Authorization: Bearer
<token>``; without one it answers only requests from this machine (a loopback address).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_safe
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from marketplace import metrics
from marketplace.monitoring import collectors, readiness

log = logging.getLogger("swarm.metrics")


@require_safe
async def healthz(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"status": "ok"})


@require_safe
async def readyz(request: HttpRequest) -> HttpResponse:
    outcomes = await readiness.readiness(settings.SWARM_READYZ_TIMEOUT_S)
    failed = [name for name, outcome in outcomes.items() if outcome != readiness.OK]
    if failed:
        return JsonResponse({"status": "unavailable", "checks": outcomes, "failed": failed}, status=503)
    return JsonResponse({"status": "ready", "checks": outcomes})


@require_safe
async def metrics_view(request: HttpRequest) -> HttpResponse:
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    timeout_s = settings.SWARM_METRICS_TIMEOUT_S
    sources: dict[str, Callable[[], list[Metric]]] = {"database": collectors.database_families}
    if collectors.broker_is_redis():
        sources["queues"] = lambda: collectors.queue_families(timeout_s)
    read = await asyncio.gather(*(_read(name, source, timeout_s) for name, source in sources.items()))
    up = GaugeMetricFamily("swarm_scrape_source_up", "1 if a source of this scrape answered in time", labels=["source"])
    families: list[Metric] = [up]
    for name, found in zip(sources, read, strict=True):
        up.add_metric([name], 0 if found is None else 1)
        families.extend(found or [])
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    body = await asyncio.to_thread(encoder, _registry(families))
    return HttpResponse(body, content_type=content_type)


async def _read(name: str, source: Callable[[], list[Metric]], timeout_s: float) -> list[Metric] | None:
    """A source's series, or None when it failed or ran past ``timeout_s`` (its thread is left to end)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(source), timeout_s)
    except Exception as exc:  # the database's or Redis's own error, or the deadline
        log.warning("metrics: the %s source failed: %r", name, exc)
        return None


class _Fixed:
    """A collector that yields series read before the scrape was rendered."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


class _ThisProcess:
    """The process's own series (``marketplace.metrics``, and prometheus-client's process and GC ones)."""

    def collect(self):
        return REGISTRY.collect()


def _registry(families: list[Metric]) -> CollectorRegistry:
    """What one scrape shows: the observed series (this process's, or every process's in
    multiprocess mode) and the series read for it."""
    registry = CollectorRegistry(auto_describe=False)
    if metrics.MULTIPROC_DIR:
        MultiProcessCollector(registry, path=metrics.MULTIPROC_DIR)
    else:
        registry.register(_ThisProcess())  # type: ignore[arg-type]
    registry.register(_Fixed(families))  # type: ignore[arg-type]
    return registry


def _refusal(request: HttpRequest) -> HttpResponse | None:
    token = settings.SWARM_METRICS_TOKEN
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
            return None
        response = JsonResponse({"error": "metrics need Authorization: Bearer <SWARM_METRICS_TOKEN>"}, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    try:
        local = ipaddress.ip_address(request.META.get("REMOTE_ADDR", "")).is_loopback
    except ValueError:
        local = False
    if local:
        return None
    return JsonResponse({"error": "metrics answer other machines only with SWARM_METRICS_TOKEN set"}, status=403)
