"""``swarm-worker`` with the tools for tests: an agent that cheats, or one behind an emulated WAN.

    SWARM_ALLOW_CHEAT=1 python -m worker_agent.dev.agent --cheat garbage join --control-plane URL ...
    python -m worker_agent.dev.agent --wan rtt=50ms serve --model tiny-llama --layers 0:6 ...

``--cheat MODE`` (one of ``cheat.MODES``; refused unless ``SWARM_ALLOW_CHEAT=1``) serves every block
as a ``CheatingStage`` on a ``CheatingServer`` and prints the cheat's warning banner; ``--wan SPEC``
holds each data-plane frame back as ``wan.WanProfile.parse(SPEC)`` says. Both may come anywhere on
the line; every other argument is ``swarm-worker``'s, which runs with these parts substituted in
(``worker_agent/agent/parts.py``).
"""

from __future__ import annotations

import argparse
import functools
import sys

from worker_agent.agent import cli
from worker_agent.agent.parts import Parts
from worker_agent.dev.cheat import CheatingServer, CheatingStage, cheat_from_option, warning_banner
from worker_agent.dev.wan import WanProfile
from worker_agent.errors import SwarmError


def parts(cheat_option: str | None, wan: str) -> Parts:
    """The parts ``--cheat`` and ``--wan`` ask for; raises SwarmError (cheat) or ValueError (wan)."""
    transport = WanProfile.parse(wan).transport()
    cheat = cheat_from_option(cheat_option)
    if cheat is None:
        return Parts(transport=transport)
    return Parts(
        stage=functools.partial(CheatingStage, cheat=cheat),
        server=CheatingServer,
        transport=transport,
        warning=warning_banner(cheat),
        reported=cheat.reported_hardware,
    )


def main(argv: list[str] | None = None) -> int:
    # No help of its own and no abbreviations: every other option, --help included, is swarm-worker's.
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--cheat", default=None)
    parser.add_argument("--wan", default="")
    options, rest = parser.parse_known_args(argv)
    try:
        chosen = parts(options.cheat, options.wan)
    except SwarmError as exc:
        print(f"error: {exc} ({exc.code})", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return cli.main(rest, parts=chosen)


if __name__ == "__main__":
    sys.exit(main())
