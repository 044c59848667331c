"""Relay hop: the round-trip latency a relay adds between a peer and an agent, on loopback.

    .venv/bin/python bench/relay_hop.py                     # 2,000 round trips each way, about 10 s
    .venv/bin/python bench/relay_hop.py --round-trips 500

Three processes, as on three hosts: the agent (a websockets echo server over mTLS with a swarm
certificate for ``<node>.swarm``, as a stage serves, and its ``RelayClient``), the relay
(``python -m worker_agent.agent.relay``, waited for on its READY line) and this one, the peer (as a
coordinator). The peer holds two connections to the same agent, one direct to its data port and
one through the relay, and sends ``--message-bytes`` (default 2,304: one token's float32 hidden
state of smollm2-135m, 576 wide) then waits for the echo. The two alternate in blocks of
``--block`` round trips, so that drift hits both alike. A relayed round trip crosses the relay's
splice and the agent's ``RelayClient`` splice, each way.

Prints the median and p90 of each and the median difference; writes
``bench/results/relay_hop.json`` with the CPU model. A measurement, not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's packages, whatever the venv's editable install points at

from nacl.signing import SigningKey  # noqa: E402 - after the path is set
from report import describe_machine, write_json  # noqa: E402 - after the path is set
from websockets.asyncio.client import ClientConnection, connect  # noqa: E402
from websockets.asyncio.server import ServerConnection, serve  # noqa: E402

from tests.test_relay import identity  # noqa: E402 - the tests' throwaway swarm CA
from worker_agent.agent.relay_client import RelayClient  # noqa: E402
from worker_agent.protocol.keys import node_id, public_key_bytes  # noqa: E402
from worker_agent.protocol.relay_pass import sign_relay_pass  # noqa: E402
from worker_agent.protocol.tls import Identity, connect_options, node_hostname  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "relay_hop.json"
LOOPBACK = "127.0.0.1"
RELAY_ID = "relay-bench"
START_TIMEOUT_S = 15.0
BLOCK_TIMEOUT_S = 60.0
WARMUP = 200  # round trips on each connection before any is timed


def agent_process(relay_port: int, relay_pass: bytes, seed: bytes, server: Identity, report: Connection) -> None:
    """The agent: serves until the parent ends it."""

    async def echo(ws: ServerConnection) -> None:
        async for message in ws:
            await ws.send(message)

    async def run() -> None:
        async with serve(echo, LOOPBACK, 0, ssl=server.server_context(), compression=None, max_size=None) as data:
            port = data.sockets[0].getsockname()[1]
            client = RelayClient((LOOPBACK, relay_port), relay_pass, SigningKey(seed), (LOOPBACK, port))
            running = asyncio.create_task(client.run())
            await asyncio.wait_for(client.registered.wait(), START_TIMEOUT_S)
            report.send((port, client.public_url(tls=True)))
            await running

    asyncio.run(run())


def start_relay(issuer: SigningKey) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "worker_agent.agent.relay", "--host", LOOPBACK, "--port", "0", "--id", RELAY_ID]
    command += ["--public-host", LOOPBACK, "--trust-key", public_key_bytes(issuer).hex(), "--log-level", "warning"]
    relay = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = relay.stdout.readline()  # READY relay=<id> port=<port>
    if not line.startswith("READY "):
        relay.kill()
        raise SystemExit(f"the relay did not start: {line!r}")
    return relay, int(line.rsplit("=", 1)[1])


async def timed(ws: ClientConnection, message: bytes, count: int) -> list[float]:
    """Seconds of each of ``count`` round trips of ``message``."""
    took = []
    async with asyncio.timeout(BLOCK_TIMEOUT_S):
        for _ in range(count):
            started = time.perf_counter()
            await ws.send(message)
            echoed = await ws.recv()
            took.append(time.perf_counter() - started)
    if echoed != message:
        raise SystemExit("the echo differs from what was sent")
    return took


async def measure(
    urls: dict[str, str], node: str, client: Identity, args: argparse.Namespace
) -> dict[str, list[float]]:
    message = os.urandom(args.message_bytes)
    context = client.client_context()
    connections = {}
    for name, url in urls.items():
        options = connect_options(url, node, context)
        connections[name] = await connect(url, compression=None, open_timeout=START_TIMEOUT_S, **options)
    try:
        for ws in connections.values():
            await timed(ws, message, WARMUP)
        samples: dict[str, list[float]] = {name: [] for name in urls}
        while len(samples["direct"]) < args.round_trips:
            for name, ws in connections.items():
                samples[name] += await timed(ws, message, min(args.block, args.round_trips - len(samples[name])))
        return samples
    finally:
        for ws in connections.values():
            await ws.close()


def summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(value * 1000 for value in seconds)
    return {
        "median": round(statistics.median(ms), 4),
        "p90": round(ms[int(0.9 * (len(ms) - 1))], 4),
        "p99": round(ms[int(0.99 * (len(ms) - 1))], 4),
        "mean": round(statistics.fmean(ms), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round-trips", type=int, default=2000, help="timed round trips on each path")
    parser.add_argument("--block", type=int, default=200, help="round trips per block; the paths alternate")
    parser.add_argument("--message-bytes", type=int, default=2304)
    args = parser.parse_args()

    issuer, node_key = SigningKey.generate(), SigningKey.generate()
    node = node_id(public_key_bytes(node_key))
    relay_pass = sign_relay_pass(issuer, node, public_key_bytes(node_key), RELAY_ID, time.time() + 3600)
    relay, relay_port = start_relay(issuer)
    spawn = multiprocessing.get_context("spawn")
    receive, report = spawn.Pipe(duplex=False)
    server = identity(node, node_hostname(node))
    agent = spawn.Process(target=agent_process, args=(relay_port, relay_pass, bytes(node_key), server, report))
    agent.start()
    try:
        if not receive.poll(START_TIMEOUT_S):
            raise SystemExit("the agent did not register at the relay")
        data_port, relay_url = receive.recv()
        urls = {"direct": f"wss://{LOOPBACK}:{data_port}", "relayed": relay_url}
        samples = asyncio.run(measure(urls, node, identity("coordinator"), args))
    finally:
        agent.terminate()
        agent.join(START_TIMEOUT_S)
        relay.terminate()
        relay.wait(START_TIMEOUT_S)

    direct, relayed = summary(samples["direct"]), summary(samples["relayed"])
    added = round(relayed["median"] - direct["median"], 4)
    result = {
        **describe_machine(),
        "round_trips": args.round_trips,
        "message_bytes": args.message_bytes,
        "transport": "websockets over mTLS, compression off; peer, relay and agent in three processes",
        "direct_ms": direct,
        "relayed_ms": relayed,
        "added_median_ms": added,
    }
    print(f"{args.round_trips} round trips of {args.message_bytes} bytes each path, on {result['cpu']}")
    for name, stats in (("direct", direct), ("relayed", relayed)):
        print(f"  {name:8} median {stats['median']:.3f} ms   p90 {stats['p90']:.3f} ms   p99 {stats['p99']:.3f} ms")
    print(f"  the relay adds {added:.3f} ms per round trip (median)")
    write_json(RESULTS, result)
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
