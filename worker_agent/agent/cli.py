# Over 500 lines: swarm-worker's commands and their one argument parser, read together.
"""``swarm-worker``: the agent a GPU owner runs.

swarm-worker keygen --out node.key
swarm-worker serve --model smollm2-135m --layers 0:10 --port 7001 --key node.key --trust-key issuer.pub
swarm-worker bench --model smollm2-135m --layers 0:10
SWARM_JOIN_TOKEN=swj_... swarm-worker join --control-plane https://HOST --tls auto
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from worker_agent import logs
from worker_agent.agent.joining import JOIN_TRIES
from worker_agent.agent.parts import Parts
from worker_agent.errors import SwarmError
from worker_agent.logs import add_log_options


def parse_span(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layer span must look like 0:10, got {text!r}") from None
    return start, end


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more, got {text!r}")
    return value


BYTE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
MAX_MEMORY = 1 << 62  # what the control plane stores of a node's memory, at most


def parse_bytes(text: str) -> int:
    """A size such as ``8GiB``, ``512MiB`` or ``1048576`` (bytes), from 1 byte up to MAX_MEMORY."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"a size looks like 8GiB, 512MiB or 1048576, got {text!r}")
    value = int(float(match.group(1)) * BYTE_UNITS[unit])
    if not 1 <= value <= MAX_MEMORY:
        raise argparse.ArgumentTypeError(f"a size must be from 1 byte to {MAX_MEMORY} bytes, got {text!r}")
    return value


def _set_threads(threads: int | None) -> None:
    from worker_agent import model as models  # torch: loaded by the commands that compute, not by --help

    models.set_threads(threads)


def _load_or_create_key(path: Path):
    # Imported per command: `keygen` and `--help` answer without loading torch.
    from worker_agent.protocol.keys import generate_signing_key, load_signing_key, write_key

    if not path.exists():
        write_key(path, generate_signing_key())
        print(f"created node key {path}", file=sys.stderr)
    return load_signing_key(path)


def cmd_keygen(args: argparse.Namespace) -> int:
    # Imported per command: `keygen` and `--help` answer without loading torch.
    from worker_agent.protocol.keys import generate_signing_key, node_id, public_key_bytes, write_key

    key = generate_signing_key()
    path = write_key(args.out, key, force=args.force)
    public = public_key_bytes(key)
    print(json.dumps({"key": str(path), "public_key": public.hex(), "node": node_id(public)}))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    # Imported per command: `keygen` and `--help` answer without loading torch.
    from worker_agent import model as models
    from worker_agent.block import Block
    from worker_agent.kvcache import SessionLimits
    from worker_agent.protocol.keys import load_verify_key

    logs.configure(args.log_format, args.log_level)
    if _refuse_device(args.device):
        return 2
    _set_threads(args.threads)
    if not args.trust_key and not args.insecure_open:
        print("error: give --trust-key (the job ticket issuer's public key) or --insecure-open", file=sys.stderr)
        return 2
    if args.insecure_open:
        print(
            "!" * 78 + "\nWARNING: --insecure-open: this agent accepts jobs WITHOUT a signed ticket.\n"
            "Anyone who can reach this port can use it. Use only for local experiments.\n" + "!" * 78,
            file=sys.stderr,
            flush=True,
        )
    parts: Parts = args.parts
    if parts.warning:
        print(parts.warning, file=sys.stderr, flush=True)
    signing_key = _load_or_create_key(Path(args.key))
    trusted = [load_verify_key(key) for key in args.trust_key]
    start, end = args.layers
    weights = models.load_block(args.model, start, end, dtype=args.dtype, device=args.device)
    limits = SessionLimits(args.max_sessions, args.max_tokens, args.idle_timeout)
    stage = parts.make_stage(
        Block(weights, max_batch=args.max_batch),
        model=models.model_name(args.model),
        signing_key=signing_key,
        trusted_keys=trusted,
        insecure_open=args.insecure_open,
        limits=limits,
    )
    server = parts.make_server(stage, max_frame=args.max_frame_mb * 1024 * 1024, max_batch=args.max_batch)

    tls = _tls_context(args)
    scheme = "wss" if tls is not None else "ws"

    def ready(port: int) -> None:
        print(
            f"READY {scheme}://{args.host}:{port} node={stage.node} model={stage.model} layers={start}:{end} "
            f"pid={os.getpid()}",
            flush=True,
        )

    try:
        asyncio.run(server.serve(args.host, args.port, ready=ready, tls=tls))
    finally:
        _report_modules()
    return 0


MODULES_REPORT_ENV = "SWARM_MODULES_REPORT"


def _report_modules() -> None:
    """Where ``SWARM_MODULES_REPORT`` names a folder, write every module this process imported
    (``sorted(sys.modules)``) to ``<folder>/<pid>.modules``: what a stage really loads, observed
    rather than assumed (tests/test_lean_stage.py checks that no transformers is among them)."""
    folder = os.environ.get(MODULES_REPORT_ENV)
    if folder:
        (Path(folder) / f"{os.getpid()}.modules").write_text("\n".join(sorted(sys.modules)) + "\n")


def _tls_context(args: argparse.Namespace):
    """The data plane's TLS server context from ``--tls-cert``/``--tls-key``; None without them."""
    if not args.tls_cert and not args.tls_key:
        return None
    if not (args.tls_cert and args.tls_key):
        raise SystemExit("error: give both --tls-cert and --tls-key (PEM files), or neither")
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(
            f"error: cannot load the TLS certificate {args.tls_cert} and key {args.tls_key}: {exc}"
        ) from None
    return context


def _tls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="serve the data plane over TLS (wss://) with this certificate"
    )
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")


def _refuse_device(device: str) -> bool:
    """Print why torch cannot run on ``device`` here, if it cannot (then the command exits 2)."""
    # Imported per command: `keygen` and `--help` answer without loading torch.
    from worker_agent.devices import device_problem

    problem = device_problem(device)
    if problem is not None:
        print(problem, file=sys.stderr)
    return problem is not None


SAME_STOP_S = 2.0  # a stop signal this soon after the first one is part of the same stop


class StopSignals:
    """Turns SIGTERM and SIGINT into calls of ``stop`` (``Agent.stop``: the first drains the jobs in
    flight, a second stops at once). A Ctrl-C reaches every process of the terminal's foreground
    group: the agent and the program that started it (a script, ``make demo``, a supervisor), which
    then often signals the agent itself. That signal is the same stop, not the owner asking to cut
    the jobs in flight: one that comes within ``window_s`` of the first is taken as part of it."""

    def __init__(
        self, stop: Callable[[], None], *, clock: Callable[[], float] = time.monotonic, window_s: float = SAME_STOP_S
    ) -> None:
        self.stop, self.clock, self.window_s = stop, clock, window_s
        self.first: float | None = None  # when the first stop signal came (clock seconds)

    def __call__(self, name: str) -> None:
        now = self.clock()
        if self.first is None:
            self.first = now
            self.stop()
        elif now - self.first < self.window_s:
            print(
                f"{name} {now - self.first:.1f}s after the first stop signal: the same stop "
                f"(signal again after {self.window_s:g}s to stop at once)",
                file=sys.stderr,
                flush=True,
            )
        else:
            self.stop()


TOKEN_ON_ARGV = (
    "error: --token would show the join token to every user of this machine (ps); give it in the "
    "SWARM_JOIN_TOKEN environment variable or in a file named by --token-file"
)


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cmd_join(args: argparse.Namespace) -> int:
    """Register with the control plane (once) and serve what it assigns, until stopped."""
    # Imported per command: `keygen` and `--help` answer without loading torch.
    from worker_agent.agent import joining
    from worker_agent.agent.control import Agent, JoinState, hardware_report, measure_compute, register
    from worker_agent.protocol import tls

    logs.configure(args.log_format, args.log_level)
    if args.token is not None:
        print(TOKEN_ON_ARGV, file=sys.stderr)
        return 2
    token = joining.read_token(args.token_file, os.environ)
    if _refuse_device(args.device):
        return 2
    _set_threads(args.threads)
    hardware = hardware_report(args.device, args.max_layers, args.dtype, memory_bytes=args.memory)
    held = int(hardware["memory_bytes"])  # what the agent holds its blocks and caches in
    hardware = args.parts.report(hardware)  # as it is, but for a test tool that lies about it
    key_path = Path(args.key)
    signing_key = _load_or_create_key(key_path)
    state_path = key_path.with_name(key_path.name + ".join.json")
    port = args.port or _free_port(args.host)
    tls_key_path = tls.agent_key_path(key_path, mode=args.tls, own_key=args.tls_key, own_certificate=args.tls_cert)
    # Without --advertise-url the agent advertises the address the control plane sees it at (its
    # Welcome says which); the join itself names this host's own bind address until then.
    advertise = args.advertise_url or f"{'wss' if tls_key_path else 'ws'}://{args.host}:{port}"
    if advertise.startswith("wss://") != (tls_key_path is not None):
        print("error: --advertise-url is wss:// exactly when the data plane serves TLS (--tls auto)", file=sys.stderr)
        return 2
    tls_key = None
    if tls_key_path and token:  # read (or made, with --tls auto) before the benchmark
        tls_key = tls.load_key(tls_key_path) if args.tls_key else tls.load_or_create_key(tls_key_path)
    saved = JoinState.load(state_path)
    if saved is not None and saved.control_plane != args.control_plane.rstrip("/"):
        saved = None
    retry, rng = joining.Retry(tries=args.join_tries), random.Random()
    if token:
        try:
            # Cheap checks first: a wrong URL or token fails now, not after the benchmark.
            joining.preflight(args.control_plane, token, retry, rng=rng)
            print(f"measuring this machine on {args.model} ...", file=sys.stderr, flush=True)
            compute = measure_compute(args.model, dtype=args.dtype, device=args.device)
            state = joining.retrying(
                lambda: register(
                    args.control_plane,
                    token,
                    signing_key,
                    compute=compute,
                    data_url=advertise,
                    hardware=hardware,
                    tls_key=tls_key,
                ),
                retry,
                rng=rng,
            )
        except joining.Refused as exc:
            if saved is None or exc.code != "invalid_join_token":
                raise
            print(f"{exc}; reconnecting as {saved.node}, which this key joined as before", file=sys.stderr)
            state = saved
        else:
            state.save(state_path)
            print(f"joined as {state.node} ({compute:.0f} layer-tokens/s)", file=sys.stderr, flush=True)
    elif saved is not None:
        state = saved
    else:
        print(
            f"error: this key has not joined {args.control_plane} yet: give the node's join token in the "
            f"{joining.TOKEN_ENV} environment variable or with --token-file",
            file=sys.stderr,
        )
        return 2
    pinned = (state.ca_certificate, state.node_certificate)
    server_tls, peer_tls = tls.agent_contexts(*pinned, tls_key_path, node=state.node)
    shown = args.advertise_url or f"{'wss' if tls_key_path else 'ws'}://(the address the control plane sees):{port}"
    print(f"JOINED node={state.node} control={state.control_url} data={shown} pid={os.getpid()}", flush=True)
    agent = Agent(
        signing_key,
        state,
        host=args.host,
        port=port,
        advertise_url=args.advertise_url,
        dtype=args.dtype,
        device=args.device,
        parts=args.parts,
        max_layers=args.max_layers,
        memory_bytes=held,
        shutdown_drain_s=args.drain_timeout,
        tls=server_tls,
        peer_tls=peer_tls,
        port_chosen=bool(args.port or args.advertise_url),
        status_path=key_path.with_name(key_path.name + ".status.json"),
    )

    async def main() -> None:
        import signal

        loop = asyncio.get_running_loop()
        signals = StopSignals(agent.stop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signals, sig.name)
        await agent.run()

    asyncio.run(main())
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Whether the agent that joined with ``--key`` is connected (its heartbeat status is fresh)."""
    # Imported per command: `keygen` and `--help` answer without loading torch.
    from worker_agent.agent.control import read_health

    key_path = Path(args.key)
    problem = read_health(key_path.with_name(key_path.name + ".status.json"), max_age_s=args.max_age)
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    print("healthy")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Throughput of this block in layer-tokens per second, for placement."""
    import torch

    # Imported per command: `keygen` and `--help` answer without loading torch.
    from worker_agent import model as models
    from worker_agent.block import Block, WorkItem
    from worker_agent.kvcache import SessionLimits, SessionStore

    if _refuse_device(args.device):
        return 2
    _set_threads(args.threads)
    start, end = args.layers
    block = Block(models.load_block(args.model, start, end, dtype=args.dtype, device=args.device))
    store = SessionStore(SessionLimits(max_sessions=args.batch + 1))
    hidden = block.hidden_size
    generator = torch.Generator().manual_seed(0)
    sessions = [store.open("bench", f"s{i}") for i in range(args.batch)]
    prompt = torch.randn(args.prompt_tokens, hidden, generator=generator)
    started = time.perf_counter()
    for kv in sessions:
        block.forward([WorkItem(kv, 0, prompt)])
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    for step in range(args.steps):
        items = [
            WorkItem(kv, args.prompt_tokens + step, torch.randn(1, hidden, generator=generator)) for kv in sessions
        ]
        block.forward(items)
    decode_s = time.perf_counter() - started
    layers = end - start
    report = {
        "model": models.model_name(args.model),
        "layers": f"{start}:{end}",
        "device": args.device,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "prefill_layer_tokens_per_s": round(layers * args.prompt_tokens * args.batch / prefill_s, 1),
        "decode_layer_tokens_per_s": round(layers * args.steps * args.batch / decode_s, 1),
        "decode_step_ms": round(1000 * decode_s / args.steps, 3),
    }
    print(json.dumps(report, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-worker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    keygen = sub.add_parser("keygen", help="create an ed25519 node key")
    keygen.add_argument("--out", default="node.key", help="private key file (the public key goes to OUT.pub)")
    keygen.add_argument("--force", action="store_true", help="overwrite an existing key")
    keygen.set_defaults(func=cmd_keygen)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="smollm2-135m", help="registry id or local HF checkpoint directory")
        p.add_argument("--layers", type=parse_span, required=True, help="layer span lo:hi (hi exclusive)")
        p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
        p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")

    serve = sub.add_parser("serve", help="serve a block of layers over WebSockets")
    model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=7001, help="0 picks a free port (printed on READY)")
    _tls_arguments(serve)
    serve.add_argument("--key", default="node.key", help="node key file (created if missing)")
    serve.add_argument(
        "--trust-key",
        action="append",
        default=[],
        help="public key (hex or file) whose job tickets this agent accepts; repeatable",
    )
    serve.add_argument("--insecure-open", action="store_true", help="accept HELLO without a ticket (local only)")
    serve.add_argument("--max-sessions", type=int, default=64)
    serve.add_argument("--max-tokens", type=int, default=4096, help="positions per session")
    serve.add_argument("--idle-timeout", type=float, default=300.0, help="seconds before an idle session is evicted")
    serve.add_argument("--max-batch", type=int, default=32, help="sessions' steps run together at most")
    serve.add_argument("--max-frame-mb", type=int, default=64)
    add_log_options(serve)
    serve.set_defaults(func=cmd_serve)

    join = sub.add_parser("join", help="join a control plane and serve the blocks it assigns")
    join.add_argument("--control-plane", required=True, help="e.g. http://127.0.0.1:8000")
    join.add_argument("--token", default=None, help=argparse.SUPPRESS)  # refused: see TOKEN_ON_ARGV
    join.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="read the node's one-time join token from this file (default: the SWARM_JOIN_TOKEN environment "
        "variable; neither is needed to reconnect once joined)",
    )
    join.add_argument(
        "--join-tries",
        type=positive_int,
        default=JOIN_TRIES,
        metavar="N",
        help="calls to the control plane while it cannot be reached or answers 5xx, when joining (waits of "
        f"up to 1, 2, 4, ... 30 s between, at random; default {JOIN_TRIES})",
    )
    join.add_argument("--key", default="node.key", help="node key file (created if missing)")
    join.add_argument("--model", default="smollm2-135m", help="model to benchmark this machine on")
    join.add_argument("--host", default="0.0.0.0", help="data-plane bind address (default every interface: 0.0.0.0)")
    join.add_argument("--port", type=int, default=0, help="data-plane port (0 picks a free one)")
    join.add_argument(
        "--advertise-url",
        default=None,
        help="ws:// or wss:// URL peers use (default: the address the control plane sees this machine at, "
        "and the data port; a relay's URL when the control plane cannot reach that)",
    )
    join.add_argument(
        "--tls",
        choices=["off", "auto"],
        default="off",
        help="auto: serve the data plane over TLS (wss://) with a key made next to --key, certified by the "
        "control plane at join; peers then trust only the control plane's CA (default off: plain ws://)",
    )
    join.add_argument(
        "--tls-key", default=None, metavar="PEM", help="as --tls auto, with this EC P-256 or Ed25519 key of your own"
    )
    join.add_argument("--tls-cert", default=None, help=argparse.SUPPRESS)  # refused: see tls.agent_key_path
    join.add_argument(
        "--max-layers",
        type=int,
        default=None,
        help="host at most this many layers at once (a block being replaced and its successor count together)",
    )
    join.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM or Ctrl-C, let the jobs in flight finish for up to S seconds first (a second signal, "
        f"{SAME_STOP_S:g} s or more after the first, stops at once; 0: stop at once)",
    )
    join.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    join.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (checked before the benchmark)")
    join.add_argument(
        "--memory",
        type=parse_bytes,
        default=None,
        metavar="SIZE",
        help="memory this agent may use for blocks and KV caches, e.g. 6GiB (default: the GPU's total, or the "
        "host's available memory at start); reported at join, and its caches never grow past it",
    )
    join.add_argument("--threads", type=int, default=None)
    add_log_options(join)
    join.set_defaults(func=cmd_join)

    health = sub.add_parser(
        "health", help="exit 0 if the agent joined with this key has its control channel up (a container healthcheck)"
    )
    health.add_argument("--key", required=True, help="the key file the agent joined with")
    health.add_argument(
        "--max-age", type=float, default=None, help="seconds since its last heartbeat (default: 3 heartbeat intervals)"
    )
    health.set_defaults(func=cmd_health)

    bench = sub.add_parser("bench", help="measure this block's throughput (layer-tokens/s)")
    model_args(bench)
    bench.add_argument("--batch", type=int, default=1, help="concurrent sessions per decode step")
    bench.add_argument("--prompt-tokens", type=int, default=64)
    bench.add_argument("--steps", type=int, default=32)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None, *, parts: Parts | None = None) -> int:
    """``parts``: what the stages are built from; the product's unless a test tool's
    (``worker_agent/dev/agent.py``)."""
    args = build_parser().parse_args(argv, namespace=argparse.Namespace(parts=parts or Parts()))
    try:
        return args.func(args)
    except SwarmError as exc:
        print(f"error: {exc} ({exc.code})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
