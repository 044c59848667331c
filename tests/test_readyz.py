"""``GET /readyz`` answers 200 while the database (and Redis and the Celery broker, where configured)
answer, and 503 naming what does not; it never waits on a dependency past its timeouts.
``GET /healthz`` stays a liveness answer that touches nothing.

The shared PostgreSQL is never stopped: the check is pointed (SWARM_READYZ_DATABASE_URL) at a port
that forwards to it and can be shut and opened again, at a closed port, or at a port that accepts
connections and never answers. Redis "down" is a closed port."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import threading
import urllib.error
import urllib.request

import pytest
from django.db import connection

from tests.live import LiveServer, free_port

pytestmark = [pytest.mark.control, pytest.mark.django_db]


class Forwarder:
    """A loopback port that forwards each connection to ``target`` while open: the database behind a
    link that goes down (the port refuses) and comes back (the same address answers again)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self.server: socketserver.ThreadingTCPServer | None = None
        self.thread: threading.Thread | None = None

    def open(self) -> None:
        target = self.target

        class Pipe(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                with socket.create_connection(target, timeout=30) as upstream:
                    back = threading.Thread(target=copy, args=(upstream, self.request), daemon=True)
                    back.start()
                    copy(self.request, upstream)
                    back.join(timeout=30)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", self.port), Pipe)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def copy(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def silent_port():
    """A port that accepts TCP connections (the kernel completes them) and never says a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


@pytest.fixture
def live(settings):
    settings.SWARM_EMBEDDED_SCHEDULER = False
    settings.SWARM_READYZ_TIMEOUT_S = 2.0
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def database_only(settings):
    """Neither Redis nor a broker configured, as in the embedded default."""
    settings.REDIS_URL = ""
    settings.CELERY_BROKER_URL = "memory://"


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def postgres_url_through(port: int) -> str:
    """The test database's URL, reached through ``port`` on loopback."""
    db = connection.settings_dict
    password = f":{db['PASSWORD']}" if db["PASSWORD"] else ""
    return f"postgres://{db['USER']}{password}@127.0.0.1:{port}/{db['NAME']}"


def unavailable(*failed: str, ok: tuple[str, ...] = ()) -> tuple[int, dict]:
    checks = {name: "ok" for name in ok} | {name: "failed" for name in failed}
    return 503, {"status": "unavailable", "checks": checks, "failed": list(failed)}


@pytest.mark.usefixtures("database_only")
def test_ready_while_the_database_answers(live):
    assert get(f"{live.url}/readyz") == (200, {"status": "ready", "checks": {"database": "ok"}})


@pytest.mark.usefixtures("database_only")
def test_not_ready_while_the_database_is_unreachable_and_ready_once_it_is_back(live, settings):
    if connection.vendor != "postgresql":
        pytest.skip("forwards to the test database's PostgreSQL server (DATABASE_URL)")
    forwarder = Forwarder(
        (connection.settings_dict["HOST"] or "127.0.0.1", int(connection.settings_dict["PORT"] or 5432))
    )
    settings.SWARM_READYZ_DATABASE_URL = postgres_url_through(forwarder.port)
    try:
        down = get(f"{live.url}/readyz")
        forwarder.open()
        back = get(f"{live.url}/readyz")
        forwarder.close()
        down_again = get(f"{live.url}/readyz")
    finally:
        forwarder.close()

    assert down == unavailable("database")
    assert back == (200, {"status": "ready", "checks": {"database": "ok"}})
    assert down_again == unavailable("database")


@pytest.mark.usefixtures("database_only")
def test_a_database_that_never_answers_fails_the_check_at_its_connect_timeout(live, settings):
    with silent_port() as port:
        settings.SWARM_READYZ_DATABASE_URL = f"postgres://postgres@127.0.0.1:{port}/swarm"

        answer = get(f"{live.url}/readyz")

    assert answer == unavailable("database")


def test_redis_and_the_broker_down_are_named(live, settings):
    closed = f"redis://127.0.0.1:{free_port()}/0"
    settings.REDIS_URL = closed
    settings.CELERY_BROKER_URL = closed

    assert get(f"{live.url}/readyz") == unavailable("redis", "broker", ok=("database",))


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs a Redis (REDIS_URL)")
def test_ready_with_redis_and_the_broker_answering(live, settings):
    settings.REDIS_URL = settings.CELERY_BROKER_URL = os.environ["REDIS_URL"]

    assert get(f"{live.url}/readyz") == (
        200,
        {"status": "ready", "checks": {"database": "ok", "redis": "ok", "broker": "ok"}},
    )


@pytest.mark.django_db(databases=[])
def test_healthz_answers_without_touching_the_database(client):
    # No database access is allowed in this test: a /healthz that queried it would raise.
    response = client.get("/healthz")

    assert (response.status_code, response.json()) == (200, {"status": "ok"})
