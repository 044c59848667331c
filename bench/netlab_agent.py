"""One host's side of ``bench/netlab.py``: an agent, or an echo server, optionally served through a relay.

    python bench/netlab_agent.py --key node.key --host 192.168.11.2 --relay 10.201.0.10:7700 \\
        --relay-pass node.pass --log agent.log -- --model smollm2-135m --layers 0:10 --trust-key issuer.key.pub
    python bench/netlab_agent.py --key echo.key --host 10.201.0.21 --relay 10.201.0.10:7700 \\
        --relay-pass echo.pass --log echo.log --echo

Without ``--echo`` it starts ``swarm-worker serve`` on ``--host`` (the arguments after ``--`` go to
it), waits for its READY line and, with ``--relay``, keeps a ``RelayClient`` linked to that relay
which splices every relayed peer onto the agent's port, as a joined agent behind NAT does
(``worker_agent/agent/relayed.py``) but with one relay and no control plane. ``--echo`` serves a
WebSocket echo (no model, no WAN emulation) instead, for timing the relay's hop alone.

It prints one line once it can be reached, ``READY direct=<url> relayed=<url or -> node=<node>``,
and runs until SIGTERM or until the agent or the relay link ends (exit 1: the benchmark then sees
the stage fail). Its log and the agent's stderr go to ``--log``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's packages, whatever the venv's editable install points at

from websockets.asyncio.server import ServerConnection, serve  # noqa: E402 - after the path is set

from worker_agent.agent.relay_client import RelayClient  # noqa: E402
from worker_agent.agent.relayed import split_address  # noqa: E402
from worker_agent.protocol.keys import load_signing_key, node_id, public_key_bytes  # noqa: E402

READY = re.compile(r"^READY ws://(\S+):(\d+) node=(\S+)")
START_TIMEOUT_S = 300.0  # torch's import, the block's load and its kernel timing, with other agents on the cores
REGISTER_TIMEOUT_S = 15.0

log = logging.getLogger("netlab_agent")


async def start_agent(args: argparse.Namespace, log_file) -> tuple[asyncio.subprocess.Process, int]:
    """``swarm-worker serve`` on ``args.host``, port picked by the OS: the process and its port. Run
    through the dev entry point, which takes ``--wan`` among the arguments after ``--``."""
    command = [sys.executable, "-m", "worker_agent.dev.agent", "serve", "--host", args.host, "--port", "0"]
    command += ["--key", args.key, *args.serve]
    agent = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE, stderr=log_file, cwd=ROOT)
    assert agent.stdout is not None
    async with asyncio.timeout(START_TIMEOUT_S):
        while line := (await agent.stdout.readline()).decode():
            if match := READY.match(line):
                return agent, int(match.group(2))
    raise SystemExit(f"swarm-worker serve exited ({await agent.wait()}) before READY: see {args.log}")


async def echo(ws: ServerConnection) -> None:
    async for message in ws:
        await ws.send(message)


async def run(args: argparse.Namespace) -> int:
    key = load_signing_key(args.key)
    node = node_id(public_key_bytes(key))
    waiting: set[asyncio.Future] = set()
    stop = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set_result, None)
    waiting.add(stop)
    with open(args.log, "ab") as log_file, contextlib.ExitStack() as stack:
        agent = None
        if args.echo:
            server = await serve(echo, args.host, 0, compression=None, max_size=None)
            stack.callback(server.close)
            port = next(iter(server.sockets)).getsockname()[1]
        else:
            agent, port = await start_agent(args, log_file)
            waiting.add(asyncio.ensure_future(agent.wait()))
        relayed = "-"
        if args.relay:
            client = RelayClient(split_address(args.relay), Path(args.relay_pass).read_bytes(), key, (args.host, port))
            linked = asyncio.ensure_future(client.run())
            waiting.add(linked)
            registered = asyncio.ensure_future(client.registered.wait())
            await asyncio.wait({registered, linked}, timeout=REGISTER_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            if not client.registered.is_set():  # refused, unreachable, or no answer in time
                registered.cancel()
                why = linked.exception() if linked.done() else f"no registration in {REGISTER_TIMEOUT_S:g} s"
                raise SystemExit(f"cannot serve through the relay at {args.relay}: {why}")
            relayed = client.public_url(tls=False)  # the bench's agents serve plain ws://
        print(f"READY direct=ws://{args.host}:{port} relayed={relayed} node={node}", flush=True)
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        for task in waiting - done:
            task.cancel()
        if agent is not None and agent.returncode is None:
            agent.terminate()
            await agent.wait()
        if stop in done:
            return 0
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.error("ended: %r", task.exception())
        return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--key", required=True, help="the node key file (its node id names the relay route)")
    parser.add_argument("--host", required=True, help="the address to serve on (the relay client reaches it there)")
    parser.add_argument("--relay", default=None, help="HOST:PORT of the relay to serve through")
    parser.add_argument("--relay-pass", default=None, help="the relay pass file, signed for this node")
    parser.add_argument("--log", required=True, help="file for this process's and the agent's log")
    parser.add_argument("--echo", action="store_true", help="serve a WebSocket echo instead of an agent")
    parser.add_argument("serve", nargs="*", help="after --: arguments for swarm-worker serve")
    args = parser.parse_args()
    if bool(args.relay) != bool(args.relay_pass):
        parser.error("--relay and --relay-pass go together")
    logging.basicConfig(filename=args.log, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
