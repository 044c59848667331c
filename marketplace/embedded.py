"""The whole ASGI app (HTTP, Channels WebSockets, lifespan) on uvicorn in a thread of this process:
the embedded control plane of `make demo`, the benchmarks and the tests."""

from __future__ import annotations

import socket
import threading
import time


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EmbeddedServer:
    """Listens on ``host`` (an IPv4 address or a host name of this machine), which its ``url`` names."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        import uvicorn

        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(
            "marketplace.asgi:application",
            host=host,
            port=self.port,
            lifespan="on",
            log_level="warning",
            log_config=None,  # uvicorn's lines go through settings.LOGGING, formatted as all the others
            ws="websockets-sansio",
            # Open WebSockets (agents' control channels, dashboards) must not hold a stop forever.
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="web", daemon=True)

    def start(self, timeout_s: float = 120.0) -> EmbeddedServer:
        """Serve from a thread of this process once the app has started (lifespan: the models'
        tokenizers loaded, which takes long on a cold, busy machine). A server that cannot start in
        ``timeout_s`` is stopped before this raises: one left starting would serve later, unowned."""
        from channels.layers import channel_layers

        # A channel layer receives on the event loop it first received on; a server started after
        # another one stopped in this process (tests) runs a new loop and needs fresh layers.
        channel_layers.backends.clear()
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the web app could not start on port {self.port} within {timeout_s:g}s")
            time.sleep(0.05)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop serving and wait for the thread to end; RuntimeError if it did not (still serving)."""
        if self.thread.ident is None:
            return  # never started
        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"the web app on port {self.port} did not stop within {timeout_s:g}s")
