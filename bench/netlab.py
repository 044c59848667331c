"""Direct, relayed and mixed pipelines on the namespace network, and the relay's own cost per hop.

    .venv/bin/python bench/netlab.py        # as root; about 2.5 minutes on 2 cores
    .venv/bin/python bench/netlab.py --no-star --repeats 1 --round-trips 500 --max-tokens 8   # under a minute

It builds ``tests/netlab``'s network (root only: network namespaces and NAT routers) and runs, on
smollm2-135m split 0:10, 10:20, 20:30, real ``swarm-worker serve`` agents on its hosts, each with
the application's WAN emulation (``--wan rtt=50ms``: each process delays its own outgoing frames by
25 ms, so every link of the pipeline costs 25 ms one way), and one coordinator on ``client`` with
the same emulation on its sends:

    pipeline  stage 0:10          stage 10:20         stage 20:30
    direct    dc1                 dc2                 cloud
    relayed   home1 (relay r1)    home2 (relay r2)    home1, a second agent (relay r1)
    mixed     dc1                 home2 (relay r2)    cloud

The relays run on cloud (r1) and dc2 (r2). A home agent sits behind its router's NAT, which lets
no connection in: ``bench/netlab_agent.py`` starts it and keeps a ``RelayClient`` linked out to its
relay, which splices each peer onto the agent's port; peers dial ``ws://RELAY:7700/relay/<node>``.
In the ring topology each stage dials its successor itself, so a relayed successor is reached
through its relay by its predecessor (a home agent's outbound connection, for a home predecessor).

1. **tok/s**: decode tokens/s of one greedy stream (plain decoding, ``speculate=False``) of
   ``--max-tokens`` new tokens: (tokens - 1) / (last token - first token), the prefill left out.
   Each pipeline's coordinator opens its stages and runs a warm-up request first; the three
   pipelines then take turns, ``--repeats`` rounds, and the median counts. Ring, then (unless
   ``--no-star``) star: the coordinator relays each stage's output to the next itself.
2. **relay hop**, WAN emulation off: round trips of ``--message-bytes`` (2,304: one token's float32
   hidden state) from ``client`` to an echo server on dc1 (no model, no emulation) that is reached
   both directly and through relay r1 on cloud, alternating in blocks; and WebSocket pings
   (answered by the agents' WebSocket library, never delayed by their emulation) to each agent of
   the pipelines at its URL, direct or relayed. Inside the lab a network round trip crosses veths
   only (microseconds), so relayed - direct is the relay's processing: its splice and the agent
   side's ``RelayClient`` splice, both ways.

The greedy tokens of every timed run are compared with the first run's (reported: they must be
equal). Targets, reported with PASS/MISS, never asserted: relay added time per hop (median) <= 1 ms.
The relayed/direct and mixed/direct tok/s ratios are informative. The table goes to stdout;
``bench/results/netlab.json`` gets the machine, the conditions, every figure and the targets.
Where the lab cannot be built (not root, no ``ip`` or ``iptables``, namespaces refused) it says why
and exits 0 without results. Everything it started is stopped and every namespace removed at the
end, on errors too.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's packages and tests.netlab, whatever the venv points at

from nacl.signing import SigningKey  # noqa: E402
from report import describe_machine, load_average, write_json  # noqa: E402 - after the path is set
from websockets.asyncio.client import connect  # noqa: E402

from tests.netlab import Netlab, NetlabUnavailable, missing_netlab_reason  # noqa: E402 - after the path is set
from worker_agent.protocol.keys import generate_signing_key, load_signing_key, node_id, public_key_bytes, write_key  # noqa: E402
from worker_agent.protocol.relay_pass import sign_relay_pass  # noqa: E402

MODEL = "smollm2-135m"
WAN = "rtt=50ms"
RESULTS = ROOT / "bench" / "results" / "netlab.json"
RELAY_PORT = 7700
RELAYS = {"r1": "cloud", "r2": "dc2"}  # relay id -> the host it runs on
# agent name -> (host, layer span, the relay it serves through or None: reached directly)
AGENTS: dict[str, tuple[str, tuple[int, int], str | None]] = {
    "dc1": ("dc1", (0, 10), None),
    "dc2": ("dc2", (10, 20), None),
    "cloud": ("cloud", (20, 30), None),
    "home1-a": ("home1", (0, 10), "r1"),
    "home2": ("home2", (10, 20), "r2"),
    "home1-b": ("home1", (20, 30), "r1"),
}
PIPELINES = {
    "direct": ["dc1", "dc2", "cloud"],
    "relayed": ["home1-a", "home2", "home1-b"],
    "mixed": ["dc1", "home2", "cloud"],
}
ECHO = ("dc1", "r1")  # the echo server's host and the relay it is also reached through
PROMPT = "Write a long story about a lighthouse keeper and a storm."
START_TIMEOUT_S = 300.0  # seven processes importing torch and loading blocks on a small machine
CLIENT_TIMEOUT_S = 600.0
PASS_TTL_S = 3600.0
HOP_GOAL_MS = 1.0
_READY = re.compile(r"^READY direct=(\S+) relayed=(\S+) node=(\S+)")


# --- the lab side (root namespace) ------------------------------------------------------------------


def new_key(workdir: Path, name: str) -> tuple[Path, str]:
    path = write_key(workdir / f"{name}.key", generate_signing_key())
    return path, node_id(public_key_bytes(load_signing_key(path)))


def start_relays(lab: Netlab, workdir: Path, pass_key_hex: str) -> None:
    processes = {}
    for relay_id, host_name in RELAYS.items():
        host = lab.hosts[host_name]
        argv = [sys.executable, "-m", "worker_agent.agent.relay", "--host", "0.0.0.0", "--port", str(RELAY_PORT)]
        argv += ["--public-host", host.address, "--trust-key", pass_key_hex, "--id", relay_id, "--log-level", "warning"]
        log = (workdir / f"relay-{relay_id}.log").open("w")
        processes[relay_id] = host.popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        log.close()  # the child holds its own copy
    for relay_id, process in processes.items():
        line = process.stdout.readline()
        if not line.startswith("READY relay="):
            raise RuntimeError(f"relay {relay_id} did not start ({line!r}): {workdir / f'relay-{relay_id}.log'}")


def start_agents(lab: Netlab, workdir: Path, issuer_pub: Path, pass_key: SigningKey) -> dict[str, dict]:
    """Every agent and the echo server, all at once; their URLs once each is READY."""
    wanted: dict[str, tuple[str, tuple[int, int] | None, str | None]] = {**AGENTS, "echo": (ECHO[0], None, ECHO[1])}
    processes = {}
    for name, (host_name, span, relay) in wanted.items():
        host = lab.hosts[host_name]
        key, node = new_key(workdir, name)
        argv = [sys.executable, str(ROOT / "bench" / "netlab_agent.py"), "--key", str(key), "--host", host.address]
        argv += ["--log", str(workdir / f"{name}.log")]
        if relay is not None:
            relay_pass = workdir / f"{name}.pass"
            expires = time.time() + PASS_TTL_S
            relay_pass.write_bytes(
                sign_relay_pass(pass_key, node, public_key_bytes(load_signing_key(key)), relay, expires)
            )
            relay_host = lab.hosts[RELAYS[relay]].address
            argv += ["--relay", f"{relay_host}:{RELAY_PORT}", "--relay-pass", str(relay_pass)]
        if span is None:
            argv += ["--echo"]
        else:
            argv += ["--", "--model", MODEL, "--layers", f"{span[0]}:{span[1]}", "--trust-key", str(issuer_pub)]
            argv += ["--threads", "1", "--wan", WAN, "--log-level", "warning"]
        processes[name] = host.popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    ready: dict[str, dict] = {}
    selector = selectors.DefaultSelector()
    for name, process in processes.items():
        selector.register(process.stdout, selectors.EVENT_READ, name)
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(ready) < len(processes):
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {START_TIMEOUT_S:g} s: {sorted(set(processes) - set(ready))}")
        for name, process in processes.items():
            if name not in ready and process.poll() is not None:
                raise RuntimeError(f"{name} exited ({process.returncode}):\n{tail(workdir / f'{name}.log')}")
        for event, _ in selector.select(timeout=0.5):
            name = event.data
            match = _READY.match(processes[name].stdout.readline())
            if match:
                selector.unregister(event.fileobj)
                direct, relayed, node = match.groups()
                host_name, span, relay = wanted[name]
                url = relayed if relay is not None else direct
                ready[name] = {"host": host_name, "span": span, "relay": relay, "node": node, "url": url}
                ready[name] |= {"direct_url": direct, "relayed_url": None if relayed == "-" else relayed}
                print(f"  {name:8} on {host_name:6} {url}", flush=True)
    return ready


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def run_lab(args: argparse.Namespace, workdir: Path) -> dict | None:
    """Build the lab, run the client's measurements in it, take it down; None where it cannot be built."""
    issuer_key, _ = new_key(workdir, "issuer")  # signs the job tickets, as a control plane does
    pass_key = generate_signing_key()  # signs the relay passes
    try:
        lab = Netlab.start()
    except NetlabUnavailable as exc:
        print(f"bench/netlab.py skipped: {exc}")
        return None
    started = time.monotonic()
    with lab:
        try:
            start_relays(lab, workdir, public_key_bytes(pass_key).hex())
            print(f"lab {lab.prefix}: relays r1 on cloud, r2 on dc2; starting agents", flush=True)
            agents = start_agents(lab, workdir, issuer_key.with_name("issuer.key.pub"), pass_key)
            print(f"agents ready in {time.monotonic() - started:.0f} s; measuring from client", flush=True)
            spec = {
                "agents": agents,
                "issuer_key": str(issuer_key),
                "max_tokens": args.max_tokens,
                "repeats": args.repeats,
                "star": args.star,
                "round_trips": args.round_trips,
                "message_bytes": args.message_bytes,
                "out": str(workdir / "client.json"),
            }
            (workdir / "spec.json").write_text(json.dumps(spec))
            client = lab.hosts["client"].popen(
                [sys.executable, str(Path(__file__).resolve()), "--client", str(workdir / "spec.json")], cwd=ROOT
            )
            if client.wait(CLIENT_TIMEOUT_S) != 0:
                raise RuntimeError(f"the client's measurements failed (exit {client.returncode})")
            measured = json.loads((workdir / "client.json").read_text())
        except BaseException:
            for name in [*AGENTS, "echo", *(f"relay-{r}" for r in RELAYS)]:
                print(f"--- {name} (log tail)\n{tail(workdir / f'{name}.log', 1500)}", file=sys.stderr)
            raise
    # Leaving the block closed the lab: it raises if any namespace or link of its prefix is left.
    print(f"lab {lab.prefix} removed: every process stopped, every namespace deleted", flush=True)
    return {"agents": agents, **measured}


# --- the client side (inside the client namespace) ------------------------------------------------------


def summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(value * 1000 for value in seconds)
    return {
        "n": len(ms),
        "median": round(statistics.median(ms), 4),
        "p90": round(ms[int(0.9 * (len(ms) - 1))], 4),
        "p99": round(ms[int(0.99 * (len(ms) - 1))], 4),
        "mean": round(statistics.fmean(ms), 4),
    }


async def open_pipeline(spec: dict, name: str, topology: str):
    """A coordinator on the pipeline's stages, opened and warmed up (the ring's links between agents
    are made by the first request)."""
    # Imported here: the lab side, which only starts processes, never loads torch.
    from worker_agent import model as models
    from worker_agent.coordinator.job import Coordinator
    from worker_agent.coordinator.pipeline import StageSpec
    from worker_agent.dev.wan import WanProfile
    from worker_agent.protocol.tickets import ticket_for_stage

    issuer = load_signing_key(spec["issuer_key"])
    job = f"netlab-{name}-{topology}"
    coordinator_key = SigningKey.generate()
    stages = []
    for agent_name in PIPELINES[name]:
        agent = spec["agents"][agent_name]
        start, end = agent["span"]
        identity = {"node": agent["node"], "model": models.model_name(MODEL), "layer_start": start, "layer_end": end}
        ticket = ticket_for_stage(issuer, job, identity, coordinator_key=bytes(coordinator_key.verify_key))
        stages.append(StageSpec(agent["url"], ticket, agent["node"]))
    coordinator = Coordinator(
        MODEL,
        stages,
        job=job,
        topology=topology,
        transport=WanProfile.parse(WAN).transport(),
        coordinator_key=coordinator_key,
    )
    await coordinator.__aenter__()
    await coordinator.generate(coordinator.request(PROMPT, chat=True, max_tokens=4, speculate=False))
    return coordinator


async def timed_run(coordinator, max_tokens: int) -> dict:
    result = await coordinator.generate(coordinator.request(PROMPT, chat=True, max_tokens=max_tokens, speculate=False))
    times = result.token_times[: len(result.token_ids)]
    span = times[-1] - times[0]
    return {
        "tokens": len(result.token_ids),
        "tok_s": round((len(times) - 1) / span, 3) if span > 0 else 0.0,
        "ttft_s": round(times[0], 3),
        "token_ids": result.token_ids,
    }


async def measure_pipelines(spec: dict, topology: str, repeats: int) -> list[dict]:
    coordinators = {}
    rows = {name: {"pipeline": name, "topology": topology, "runs": []} for name in PIPELINES}
    try:
        for name in PIPELINES:
            coordinators[name] = await open_pipeline(spec, name, topology)
        for _ in range(repeats):  # the pipelines take turns, so that drift on the machine hits each alike
            for name, coordinator in coordinators.items():
                run = await timed_run(coordinator, spec["max_tokens"])
                rows[name]["runs"].append(run)
                print(f"  {topology:4} {name:8} {run['tok_s']:6.2f} tok/s ({run['tokens']} tokens)", flush=True)
    finally:
        for coordinator in coordinators.values():
            await coordinator.__aexit__(None, None, None)
    for row in rows.values():
        row["tok_s_median"] = round(statistics.median(run["tok_s"] for run in row["runs"]), 3)
        row["ttft_s_median"] = round(statistics.median(run["ttft_s"] for run in row["runs"]), 3)
    return list(rows.values())


async def echo_hop(spec: dict) -> dict:
    """Round trips of one message to the same echo server, directly and through the relay, in
    alternating blocks."""
    echo = spec["agents"]["echo"]
    message = os.urandom(spec["message_bytes"])
    urls = {"direct": echo["direct_url"], "relayed": echo["relayed_url"]}
    connections = {name: await connect(url, compression=None, ping_interval=None) for name, url in urls.items()}
    samples: dict[str, list[float]] = {name: [] for name in urls}

    async def block(name: str, count: int) -> list[float]:
        ws, took = connections[name], []
        async with asyncio.timeout(60):
            for _ in range(count):
                started = time.perf_counter()
                await ws.send(message)
                if await ws.recv() != message:
                    raise RuntimeError("the echo differs from what was sent")
                took.append(time.perf_counter() - started)
        return took

    try:
        for name in urls:
            await block(name, 200)  # warm-up: connections, buffers, the relay's splice
        while len(samples["direct"]) < spec["round_trips"]:
            for name in urls:
                samples[name] += await block(name, 100)
    finally:
        for ws in connections.values():
            await ws.close()
    direct, relayed = summary(samples["direct"]), summary(samples["relayed"])
    return {"direct_ms": direct, "relayed_ms": relayed, "added_ms": round(relayed["median"] - direct["median"], 4)}


async def ping_hop(spec: dict) -> dict:
    """WebSocket pings to every pipeline agent at its URL, round robin in blocks."""
    agents = {name: spec["agents"][name] for name in AGENTS}
    connections = {name: await connect(a["url"], compression=None, ping_interval=None) for name, a in agents.items()}
    samples: dict[str, list[float]] = {name: [] for name in agents}

    async def block(name: str, count: int) -> list[float]:
        took = []
        async with asyncio.timeout(60):
            for _ in range(count):
                started = time.perf_counter()
                await (await connections[name].ping())
                took.append(time.perf_counter() - started)
        return took

    try:
        for name in agents:
            await block(name, 50)
        while len(samples["dc1"]) < spec["round_trips"]:
            for name in agents:
                samples[name] += await block(name, 100)
    finally:
        for ws in connections.values():
            await ws.close()
    per_agent = {name: {"relay": agents[name]["relay"], **summary(seconds)} for name, seconds in samples.items()}
    direct = [s for name, seconds in samples.items() if agents[name]["relay"] is None for s in seconds]
    relayed = [s for name, seconds in samples.items() if agents[name]["relay"] is not None for s in seconds]
    direct_ms, relayed_ms = summary(direct), summary(relayed)
    return {
        "per_agent_ms": per_agent,
        "direct_ms": direct_ms,
        "relayed_ms": relayed_ms,
        "added_ms": round(relayed_ms["median"] - direct_ms["median"], 4),
    }


def client_main(spec_path: Path) -> int:
    import torch  # here: only the client's half computes (the coordinator's embeddings and head)

    torch.set_num_threads(1)  # as each agent: two cores, seven processes
    spec = json.loads(spec_path.read_text())
    topologies = ["ring", "star"] if spec["star"] else ["ring"]
    rows = []
    for topology in topologies:
        rows += asyncio.run(measure_pipelines(spec, topology, spec["repeats"]))
    print("  relay hop: echo and pings, WAN emulation off", flush=True)
    echo, ping = asyncio.run(echo_hop(spec)), asyncio.run(ping_hop(spec))
    Path(spec["out"]).write_text(json.dumps({"torch": torch.__version__, "rows": rows, "echo": echo, "ping": ping}))
    return 0


# --- report ----------------------------------------------------------------------------------------


def hosts_of(agents: dict, name: str) -> str:
    return ", ".join(
        agents[a]["host"] + (f" via {agents[a]['relay']}" if agents[a]["relay"] else "") for a in PIPELINES[name]
    )


def report(measured: dict, args: argparse.Namespace) -> tuple[list[str], list[dict], dict]:
    agents, rows = measured["agents"], measured["rows"]
    first = rows[0]["runs"][0]["token_ids"]
    runs = [run for row in rows for run in row["runs"]]
    equal = sum(run["token_ids"] == first for run in runs)
    base = {row["topology"]: row["tok_s_median"] for row in rows if row["pipeline"] == "direct"}
    lines = [f"{'pipeline':<8} {'topo':<4} {'stages (0:10, 10:20, 20:30)':<42} {'tok/s runs':<16} {'median':>6} "
             f"{'x direct':>8} {'ttft s':>6}"]  # fmt: skip
    for row in rows:
        row["ratio_to_direct"] = round(row["tok_s_median"] / base[row["topology"]], 3)
        row["tokens_equal_first_run"] = all(run["token_ids"] == first for run in row["runs"])
        tok_s = " ".join(f"{run['tok_s']:.2f}" for run in row["runs"])
        lines.append(
            f"{row['pipeline']:<8} {row['topology']:<4} {hosts_of(agents, row['pipeline']):<42} {tok_s:<16} "
            f"{row['tok_s_median']:>6.2f} {row['ratio_to_direct']:>8.3f} {row['ttft_s_median']:>6.3f}"
        )
    echo, ping = measured["echo"], measured["ping"]
    links = []
    for row in rows:
        stages = PIPELINES[row["pipeline"]]
        if row["topology"] == "ring":
            # Each ring stage dials its successor itself: a relayed one at its relay URL.
            row["ring_successors"] = [f"{a} -> {agents[b]['url']}" for a, b in itertools.pairwise(stages)]
            links += [
                f"{a} -> {b} via {agents[b]['relay']}" for a, b in itertools.pairwise(stages) if agents[b]["relay"]
            ]
    lines += [
        f"greedy tokens equal across all {len(runs)} timed runs: {equal}/{len(runs)}",
        f"ring stages that dialed a relayed successor at its relay URL: {', '.join(dict.fromkeys(links))}",
        "",
        f"{'relay hop, WAN emulation off: round trip from client, median (p90) ms':<72} {'direct':<14} "
        f"{'relayed':<14} added",
        f"{spec_label(echo, args.message_bytes, 'byte echo, one server on dc1, direct / via r1'):<72} {hop(echo)}",
        f"{spec_label(ping, None, 'WebSocket ping, the 3 direct / 3 relayed agents'):<72} {hop(ping)}",
    ]
    for name, stats in ping["per_agent_ms"].items():
        lines.append(f"  ping {name:<8} {('via ' + stats['relay']) if stats['relay'] else 'direct':<7} "
                     f"median {stats['median']:.3f} ms  p90 {stats['p90']:.3f} ms")  # fmt: skip
    checks = [
        target(f"relay added time per hop, {args.message_bytes}-byte echo (ms, median)", echo["added_ms"]),
        target("relay added time per hop, WebSocket ping to agents (ms, median)", ping["added_ms"]),
    ]
    for row in rows:
        if row["pipeline"] != "direct":
            name = f"{row['pipeline']} / direct tok/s, {row['topology']} (informative)"
            checks.append({"target": name, "value": row["ratio_to_direct"], "met": None})
    for check in checks:
        verdict = "info" if check["met"] is None else "PASS" if check["met"] else "MISS"
        goal = f" (goal <= {check['goal']})" if "goal" in check else ""
        lines.append(f"target {check['target']}: {check['value']}{goal} {verdict}")
    tokens = {"equal_runs": equal, "runs": len(runs), "all_equal": equal == len(runs), "token_ids": first}
    for run in runs:  # every run's ids are in the count above; the JSON keeps the first run's
        del run["token_ids"]
    return lines, checks, tokens


def spec_label(stats: dict, message_bytes: int | None, text: str) -> str:
    n = stats["direct_ms"]["n"]
    return f"{f'{message_bytes:,}-' if message_bytes else ''}{text} ({n:,} each)"


def hop(stats: dict) -> str:
    d, r = stats["direct_ms"], stats["relayed_ms"]
    direct, relayed = f"{d['median']:.3f} ({d['p90']:.3f})", f"{r['median']:.3f} ({r['p90']:.3f})"
    return f"{direct:<14} {relayed:<14} {stats['added_ms']:+.3f}"


def target(name: str, value: float) -> dict:
    return {"target": name, "value": value, "relation": "<=", "goal": HOP_GOAL_MS, "met": value <= HOP_GOAL_MS}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per timed stream (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per pipeline and topology (default 3)")
    parser.add_argument("--no-star", dest="star", action="store_false", help="skip the star topology")
    parser.add_argument("--round-trips", type=int, default=1000, help="timed round trips per path (default 1000)")
    parser.add_argument("--message-bytes", type=int, default=2304, help="echo message size (default 2304)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="default bench/results/netlab.json")
    parser.add_argument("--client", type=Path, help=argparse.SUPPRESS)  # the measuring half, run on `client`
    args = parser.parse_args()
    if args.max_tokens < 2 or args.repeats < 1:
        parser.error("--max-tokens >= 2 (a decode rate needs two tokens) and --repeats >= 1")
    if args.round_trips < 100 or args.round_trips % 100:
        parser.error("--round-trips is a multiple of 100 (the block size)")
    return args


def main() -> int:
    args = parse_args()
    if args.client is not None:
        return client_main(args.client)
    reason = missing_netlab_reason()
    if reason is not None:
        print(f"bench/netlab.py skipped: {reason}")
        return 0
    started = time.monotonic()
    machine = describe_machine(load_average_at_start=load_average())
    print(
        f"machine: {machine['cpu']}, {machine['cpu_count']} CPUs, load average {machine['load_average_at_start']}\n"
        f"{MODEL} in 3 stages (0:10, 10:20, 20:30), WAN emulation {WAN} on every sender, one torch thread per "
        f"process, {args.max_tokens} new tokens per timed stream, greedy, plain decoding",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="netlab-bench-") as tmp:
        measured = run_lab(args, Path(tmp))
    if measured is None:
        return 0
    machine["torch"] = measured.pop("torch")
    machine["load_average_at_end"] = load_average()
    lines, checks, tokens = report(measured, args)
    print("\n" + "\n".join(lines))
    result = {
        "benchmark": "netlab",
        "command": " ".join(["python", "bench/netlab.py", *sys.argv[1:]]),
        "date": datetime.now(UTC).date().isoformat(),
        "machine": machine,
        "conditions": {
            "model": MODEL,
            "stages": ["0:10", "10:20", "20:30"],
            "wan": f"{WAN}: every agent and the coordinator delay their own outgoing frames by 25 ms; relays add none",
            "max_new_tokens": args.max_tokens,
            "decoding": "greedy, plain (speculate=False), one stream, after a warm-up request per coordinator",
            "repeats": args.repeats,
            "topologies": ["ring", "star"] if args.star else ["ring"],
            "pipelines": {name: hosts_of(measured["agents"], name) for name in PIPELINES},
            "relays": {relay: f"{host}:{RELAY_PORT}" for relay, host in RELAYS.items()},
            "agents": measured["agents"],
            "coordinator": "client (10.201.0.30)",
            "relay_hop": (
                f"WAN emulation off; {args.round_trips} timed round trips per path after a warm-up, alternating in "
                f"blocks of 100; echo of {args.message_bytes} bytes to one server on dc1 directly and via r1 on "
                "cloud; WebSocket pings to each pipeline agent at its URL"
            ),
            "torch_threads_per_process": 1,
            "prompt": PROMPT,
        },
        "pipelines": measured["rows"],
        "greedy_tokens": tokens,
        "relay_hop": {"echo": measured["echo"], "ping": measured["ping"]},
        "targets": checks,
        "lab_removed": True,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.output, result)
    print(f"\nwrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output} "
          f"in {result['elapsed_s']} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
