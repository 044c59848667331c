"""``swarm-coordinator`` behind an emulated WAN, for tests and benchmarks.

    python -m worker_agent.dev.coordinator --wan rtt=50ms generate --model smollm2-135m --stages ...

``--wan SPEC`` holds each frame the coordinator sends back as ``wan.WanProfile.parse(SPEC)`` says;
it may come anywhere on the line, and every other argument is ``swarm-coordinator``'s, which runs
with that transport substituted in.
"""

from __future__ import annotations

import argparse
import sys

from worker_agent.coordinator import cli
from worker_agent.dev.wan import WanProfile


def main(argv: list[str] | None = None) -> int:
    # No help of its own and no abbreviations: every other option, --help included, is swarm-coordinator's.
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--wan", default="")
    options, rest = parser.parse_known_args(argv)
    try:
        profile = WanProfile.parse(options.wan)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return cli.main(rest, transport=profile.transport())


if __name__ == "__main__":
    sys.exit(main())
