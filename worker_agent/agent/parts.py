"""What the agent builds the stages it serves from: the product's parts, or a test tool's.

``swarm-worker`` serves each block as a plain ``Stage`` on a plain ``StageServer`` whose frames go
straight to the socket (``DirectLink``). The tools for tests run the same command with other parts
(``python -m worker_agent.dev.agent``, which hands them to ``cli.main``): a stage that cheats on
purpose and the server that shows it each job's route, frames held back as on a wide-area link, and
a warning to print at start. Nothing in the product builds other parts, so none of that can be
switched on in it::

    Parts()                                            # the product's
    Parts(stage=partial(CheatingStage, cheat=cheat), server=CheatingServer, warning=banner)
    Parts(reported=cheat.reported_hardware, warning=banner)   # honest stages, a false memory report
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from worker_agent.protocol.transport import DirectLink, LinkFactory

if TYPE_CHECKING:
    from worker_agent.block import Block
    from worker_agent.server import StageServer
    from worker_agent.stage import Stage


@dataclass(frozen=True)
class Parts:
    stage: Callable[..., Stage] | None = None  # called as Stage is; None: Stage
    server: Callable[..., StageServer] | None = None  # called as StageServer is; None: StageServer
    transport: LinkFactory = DirectLink  # each data-plane connection's link (``transport.py``)
    warning: str = ""  # printed at start (serve) or logged (join), loudly: what makes these parts not the product's
    # What the agent reports of its machine at join (``control.hardware_report``'s dict): None
    # reports it as it is; a test tool's may lie about it (dev/cheat.py's claim-memory).
    reported: Callable[[dict], dict] | None = None

    def report(self, hardware: dict) -> dict:
        return hardware if self.reported is None else self.reported(dict(hardware))

    def make_stage(self, block: Block, **kwargs: Any) -> Stage:
        if self.stage is not None:
            return self.stage(block, **kwargs)
        # Imported when a block is served: `keygen`, `--help` and joining need no torch.
        from worker_agent.stage import Stage

        return Stage(block, **kwargs)

    def make_server(self, stage: Stage, **kwargs: Any) -> StageServer:
        if self.server is not None:
            return self.server(stage, transport=self.transport, **kwargs)
        # Imported when a block is served: `keygen`, `--help` and joining need no torch.
        from worker_agent.server import StageServer

        return StageServer(stage, transport=self.transport, **kwargs)
