"""How a data-plane connection's outgoing frames reach its socket.

Every connection of the data plane (a stage's, each of the coordinator's) sends through a ``Link``
that a ``LinkFactory`` makes from the socket's ``send``. The product's is ``DirectLink``: each frame
goes straight to the socket. Whoever builds a ``StageServer``, ``Pipeline`` or ``Coordinator`` may
pass another factory; WAN emulation (``worker_agent/dev/wan.py``) does, to hold frames back as a
wide-area link would, for tests and benchmarks::

    link = DirectLink(websocket.send)
    await link.send(frame)      # returns once the socket took it
    await link.drain()          # waits until every frame sent was handed to the socket
    await link.aclose()         # a later send raises RuntimeError
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

Send = Callable[[bytes], Awaitable[None]]


class Link(Protocol):
    """One connection's outgoing frames, in order."""

    async def send(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    async def aclose(self) -> None: ...


LinkFactory = Callable[[Send], Link]


class DirectLink:
    """Each frame straight to the socket: nothing is queued, so ``drain`` has nothing to wait for."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._closed = False

    async def send(self, data: bytes) -> None:
        # The error every Link raises here: the server's sends to a connection that is going away
        # (closed on another path meanwhile) suppress it.
        if self._closed:
            raise RuntimeError("send on a closed link")
        await self._send(data)

    async def drain(self) -> None:
        return None

    async def aclose(self) -> None:
        self._closed = True
