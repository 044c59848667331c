"""An agent's Prometheus series, answered at ``GET /metrics`` on its data-plane port.

The stage server (``server.py``) answers plain HTTP ``GET /metrics`` before the WebSocket handshake
(websockets' ``process_request`` hook), so an agent needs no second port. Each server has a
registry of its own, so that several servers in one process (tests, benchmarks) keep apart.

The frame path only increments: bytes in and out, ERROR frames sent by code, batch sizes and
layer-tokens computed (token rows times the block's layers: its rate is the agent's layer-tokens/s).
What is open now (jobs, sessions) is read from the server at scrape time.

    curl http://127.0.0.1:7001/metrics
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from worker_agent.protocol.span import Span

PATH = "/metrics"


@dataclass(frozen=True)
class BlockLoad:
    """What one block served on the port has open now."""

    span: Span  # the block: its model and layers (the series' labels)
    jobs: int  # jobs whose coordinator is connected
    sessions: int  # KV-cache sessions open


class _OpenNow:
    """Reads the blocks' open jobs and sessions when scraped."""

    def __init__(self, blocks: Callable[[], Iterable[BlockLoad]]) -> None:
        self.blocks = blocks

    def collect(self) -> list[Metric]:
        labels = ["model", "layer_start", "layer_end"]
        jobs = GaugeMetricFamily("swarm_agent_jobs_open", "Jobs open on each block served here", labels=labels)
        sessions = GaugeMetricFamily(
            "swarm_agent_sessions_open", "KV-cache sessions open on each block served here", labels=labels
        )
        for block in self.blocks():
            key = [block.span.model, str(block.span.start), str(block.span.end)]
            jobs.add_metric(key, block.jobs)
            sessions.add_metric(key, block.sessions)
        return [jobs, sessions]


class AgentMetrics:
    """One stage server's series; ``blocks`` lists what its blocks have open (read at scrape time)."""

    def __init__(self, blocks: Callable[[], Iterable[BlockLoad]]) -> None:
        self.registry = CollectorRegistry()
        self.bytes_in = Counter(
            "swarm_agent_received_bytes", "Data-plane bytes received (WebSocket messages)", registry=self.registry
        )
        self.bytes_out = Counter(
            "swarm_agent_sent_bytes", "Data-plane bytes sent (WebSocket messages)", registry=self.registry
        )
        self.errors = Counter("swarm_agent_errors_sent", "ERROR frames sent, by code", ["code"], registry=self.registry)
        self.batch_items = Histogram(
            "swarm_agent_batch_items",
            "Session steps computed together in one pass of a block (continuous batching)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=self.registry,
        )
        self.layer_tokens = Counter(
            "swarm_agent_layer_tokens",
            "Token rows computed times the layers of the block that computed them, by model",
            ["model"],
            registry=self.registry,
        )
        self.registry.register(_OpenNow(blocks))  # type: ignore[arg-type]

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition (Prometheus text, or OpenMetrics if ``accept`` asks for it) and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def answer(self, request: Request) -> Response | None:
        """The HTTP answer to ``GET /metrics``; None for any other request (the WebSocket handshake goes on)."""
        if request.path.partition("?")[0] != PATH:
            return None
        body, content_type = self.render(request.headers.get("Accept", ""))
        headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))), ("Connection", "close")])
        return Response(200, "OK", headers, body)
