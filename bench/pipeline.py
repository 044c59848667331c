"""Pipeline throughput against single-process ``generate``, over emulated WAN round trips.

    .venv/bin/python bench/pipeline.py            # the full run (``make bench``), a few minutes
    .venv/bin/python bench/pipeline.py --quick    # a smoke run of the same code paths

In one run, on smollm2-135m split into three stages (layers 0:10, 10:20, 20:30):

1. the reference: Hugging Face greedy ``generate`` in one process (fp32), timed after a warm-up
   with each of ``--reference-threads`` torch thread counts, the fastest counting; it runs in a
   child process so that its full copy of the model weighs on neither the coordinator's memory
   nor the agents';
2. the pipeline: three ``swarm-worker serve`` processes on loopback (``LocalSwarm``) and a
   coordinator in this process, ring topology, with every link (coordinator -> A -> B -> C ->
   coordinator) delayed by half the round trip, for each round trip and each number of
   concurrent streams (one coordinator job per round trip, the streams gathered in it).

What is measured (the same for the reference and the pipeline):

- decode tokens/s of a stream: (generated tokens - 1) / (time of its last token - time of its
  first), so the prefill is left out; TTFT (request start to first token) is reported apart.
- aggregate tokens/s of C streams: the sum over streams of (generated tokens - 1) divided by
  the time from the earliest first token to the latest last token.
- wire bytes per token per hop: every decode frame (a FORWARD or RESULT whose items are all
  single tokens) that the coordinator sends or receives, re-encoded exactly as the codec does,
  plus its WebSocket header (2-8 bytes, masked when the sender is the client), divided by the
  token rows it carries. Ring agents re-send the same FORWARD between themselves, so the hops
  the coordinator sees stand for all of them. TCP/IP headers are not counted.
- resident memory (RSS, psutil) of every agent, of this process (the coordinator) and of the
  reference process, after loading, after a warm-up and after the runs, with the part of it
  that is checkpoint pages (none is expected: each process copies the weights it loads into
  memory of its own and lets the file's pages go).

The agents and the coordinator multiply by their weights with ``kernels.linear``: each process
times the products it could use for each weight shape and row count when it loads, on this
machine, and keeps the fastest where the difference is conclusive (``worker_agent/kernels.py``).
What each agent and the coordinator chose goes into the JSON. The reference is timed with Hugging
Face's own ``nn.Linear`` (the ratio that counts) and once more with the same choice of products,
made by the same timing in the reference's process (same threads, first prompt): the pipeline's
ratio to that one is what the pipeline itself costs (transport, coordination).

Targets are reported, not asserted: single-stream throughput at 0 ms >= 0.9x the reference
with Hugging Face's products and >= 0.95x with the same products; at 200 ms, 3 streams >= 2.4x
the single-stream aggregate; bytes/token/hop <= hidden x 4 + 256.
The table goes to stdout, everything else to ``bench/results/pipeline.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from report import describe_machine, load_average, write_json
from safetensors import safe_open

from worker_agent import kernels
from worker_agent import model as models
from worker_agent.coordinator.job import Coordinator, GenerationResult
from worker_agent.coordinator.pipeline import Pipeline, StageSpec
from worker_agent.coordinator.session import TokenEvent
from worker_agent.dev.local import LocalSwarm
from worker_agent.dev.wan import WanProfile
from worker_agent.protocol import wire

MODEL = "smollm2-135m"
SPANS = [(0, 10), (10, 20), (20, 30)]
RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"
# Requests that make the model write at length, so greedy decoding rarely stops before the budget.
PROMPTS = [
    "Write a long, detailed essay about the history of the Roman Empire.",
    "Explain in detail how a steam engine works, step by step.",
    "Describe the water cycle in detail for a school textbook chapter.",
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain the rules of chess thoroughly for a complete beginner.",
    "Give a detailed guide to planting and caring for a vegetable garden.",
]
MB = 1024 * 1024


@dataclass
class StreamRun:
    started: float  # perf_counter at the request
    token_times: list[float]  # perf_counter at each generated token
    result: GenerationResult

    @property
    def tokens(self) -> int:
        return len(self.result.token_ids)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.started

    @property
    def decode_rate(self) -> float:
        return decode_rate(self.token_times)


def decode_rate(token_times: list[float]) -> float:
    span = token_times[-1] - token_times[0] if len(token_times) > 1 else 0.0
    return (len(token_times) - 1) / span if span > 0 else 0.0


def ws_header(size: int, *, masked: bool) -> int:
    """Bytes of the WebSocket header of one binary frame (RFC 6455)."""
    extended = 0 if size < 126 else 2 if size < 65536 else 8
    return 2 + extended + (4 if masked else 0)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt exactly as ``Coordinator.request(prompt, chat=True)`` tokenizes it."""
    messages = [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def memory(pid: int | None = None) -> dict:
    """A process's RSS, the part of it that is checkpoint file pages still mapped (safetensors), and
    its USS (the pages no other process maps: not the shared libraries' code, which every agent on
    a host shares, e.g. libtorch's)."""
    process = psutil.Process(pid)
    mapped = sum(m.rss for m in process.memory_maps(grouped=True) if m.path.endswith(".safetensors"))
    return {
        "rss_mb": round(process.memory_info().rss / MB, 1),
        "uss_mb": round(process.memory_full_info().uss / MB, 1),
        "checkpoint_mapped_mb": round(mapped / MB, 1),
    }


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


# --- the reference: single-process generate, run in a child process -------------------------


def reference(prompts: list[str], max_tokens: int, thread_counts: list[int]) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """Time of every generated token: generate puts the prompt first, then each new token."""

        def __init__(self) -> None:
            self.puts = 0
            self.times: list[float] = []

        def put(self, value) -> None:
            if self.puts:
                self.times.append(time.perf_counter())
            self.puts += 1

        def end(self) -> None:
            pass

    after_imports = memory()
    tokenizer = models.load_tokenizer(MODEL)
    model = AutoModelForCausalLM.from_pretrained(models.resolve_checkpoint(MODEL), dtype=torch.float32).eval()
    after_load = memory()
    eos = tokenizer.eos_token_id

    def run(prompt: str) -> dict:
        ids = torch.tensor([chat_ids(tokenizer, prompt)])
        clock = Clock()
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                streamer=clock,
                pad_token_id=eos,
            )
        tokens = out[0, ids.shape[1] :].tolist()
        if tokens and tokens[-1] == eos:  # the pipeline does not count the EOS token either
            tokens.pop()
        times = clock.times[: len(tokens)]
        return {
            "prompt_tokens": ids.shape[1],
            "token_ids": tokens,
            "ttft_s": round(times[0] - started, 4),
            "decode_tok_s": round(decode_rate(times), 2),
        }

    # The reference is local generate at its best: each thread count is timed after a warm-up,
    # and the fastest one counts.
    by_threads = {}
    for threads in thread_counts:
        torch.set_num_threads(threads)
        run(prompts[0])
        by_threads[threads] = run(prompts[0])
    best = max(by_threads, key=lambda t: by_threads[t]["decode_tok_s"])
    torch.set_num_threads(best)
    runs = [by_threads[best], *(run(prompt) for prompt in prompts[1:])]
    # The same generate with the products that timing on this machine chooses, as the agents and
    # the coordinator compute: what the pipeline costs beyond the maths.
    kernels.tune_module(model)
    plain_forward = torch.nn.Linear.forward

    def chosen_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)

    torch.nn.Linear.forward = chosen_forward
    try:
        run(prompts[0])
        same_products = run(prompts[0])
    finally:
        torch.nn.Linear.forward = plain_forward
    return {
        "threads": best,
        "decode_tok_s": by_threads[best]["decode_tok_s"],
        "same_products": {
            "decode_tok_s": same_products["decode_tok_s"],
            "tokens_equal": same_products["token_ids"] == by_threads[best]["token_ids"],
            "kernels": kernels.TABLE.choices(),
        },
        "ttft_s": by_threads[best]["ttft_s"],
        "by_threads": {t: {k: r[k] for k in ("decode_tok_s", "ttft_s")} for t, r in by_threads.items()},
        "runs": runs,
        "memory": {"after_imports": after_imports, "after_load": after_load, "after_runs": memory()},
    }


def run_reference_process(prompts: list[str], max_tokens: int, thread_counts: list[int]) -> dict:
    command = [
        sys.executable,
        __file__,
        "--reference-child",
        "--max-tokens",
        str(max_tokens),
        "--reference-threads",
        ",".join(map(str, thread_counts)),
        "--prompts",
        json.dumps(prompts),
    ]
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout)


# --- the pipeline -------------------------------------------------------------------------------


@dataclass
class FrameMeter:
    """Counts the decode frames the coordinator sends and receives, by wrapping its pipeline."""

    pipeline: Pipeline
    frame_bytes: int = 0
    rows: int = 0
    frames: int = 0
    results_seen: dict[int, int] = field(default_factory=dict)

    def install(self) -> None:
        for link in self.pipeline.links:
            link.send = self._wrap_send(link)
        on_result = self.pipeline.on_result

        def counted_on_result(index: int, result: wire.Result) -> None:
            # The stage numbered its frame; our count of its frames gives the same encoded width.
            self.results_seen[index] = self.results_seen.get(index, 0) + 1
            self._count(result, wire.encode(result, self.results_seen[index]), masked=False)
            on_result(index, result)

        self.pipeline.on_result = counted_on_result

    def _wrap_send(self, link):
        send = link.send

        async def counted_send(message: wire.Message) -> None:
            if isinstance(message, wire.Forward):
                self._count(message, wire.encode(message, link.seq + 1), masked=True)
            await send(message)

        return counted_send

    def _count(self, message: wire.Forward, data: bytes, *, masked: bool) -> None:
        if all(item.count == 1 for item in message.items):
            self.frame_bytes += len(data) + ws_header(len(data), masked=masked)
            self.rows += message.shape[0]
            self.frames += 1

    def reset(self) -> None:
        self.frame_bytes = self.rows = self.frames = 0


async def timed_stream(coordinator: Coordinator, prompt: str, max_tokens: int) -> StreamRun:
    request = coordinator.request(prompt, chat=True, max_tokens=max_tokens, speculate=False)
    started = time.perf_counter()
    times: list[float] = []
    result = None
    async for event in coordinator.stream(request):
        if isinstance(event, TokenEvent):
            times.append(time.perf_counter())
        else:
            result = event
    assert result is not None
    # A stream that ends on EOS yields an event for it too, but EOS is not a generated token.
    return StreamRun(started, times[: len(result.token_ids)], result)


async def measure(
    coordinator: Coordinator,
    meter: FrameMeter,
    processes: dict[str, psutil.Process],
    prompts: list[str],
    max_tokens: int,
    expected: list[list[int]],
) -> dict:
    meter.reset()
    cpu = {name: cpu_seconds(process) for name, process in processes.items()}
    started = time.perf_counter()
    runs = await asyncio.gather(*(timed_stream(coordinator, p, max_tokens) for p in prompts))
    wall = time.perf_counter() - started
    cpu = {name: cpu_seconds(process) - cpu[name] for name, process in processes.items()}
    window = max(r.token_times[-1] for r in runs) - min(r.token_times[0] for r in runs)
    decode_tokens = sum(r.tokens - 1 for r in runs)
    tokens = sum(r.tokens for r in runs)
    return {
        "streams": len(prompts),
        "completion_tokens": [r.tokens for r in runs],
        "aggregate_tok_s": round(decode_tokens / window, 2) if window > 0 else 0.0,
        "per_stream_tok_s": round(sum(r.decode_rate for r in runs) / len(runs), 2),
        "ttft_s": round(sum(r.ttft for r in runs) / len(runs), 3),
        "ttft_max_s": round(max(r.ttft for r in runs), 3),
        "bytes_per_token_hop": round(meter.frame_bytes / meter.rows, 1) if meter.rows else None,
        "decode_frames": meter.frames,
        "rows_per_decode_frame": round(meter.rows / meter.frames, 2) if meter.frames else None,
        "wall_s": round(wall, 3),
        "cpu_busy": round(sum(cpu.values()) / wall / (os.cpu_count() or 1), 3),
        "cpu_ms_per_token": {name: round(1000 * seconds / tokens, 2) for name, seconds in cpu.items()},
        "tokens_equal_reference": sum(r.result.token_ids == want for r, want in zip(runs, expected, strict=True)),
        "receipts_verified": all(r.result.verification is not None for r in runs),
    }


async def run_swarm(
    swarm: LocalSwarm, rtt: int, topology: str, streams: list[int], max_tokens: int, expected: list[list[int]]
) -> tuple[list[dict], dict]:
    """Every row of one swarm, in one coordinator job; and the processes' memory along the way."""
    job = f"bench-{topology}-rtt{rtt}"
    specs = [StageSpec(url, ticket) for url, ticket in zip(swarm.urls, swarm.tickets(job), strict=True)]
    processes = {"coordinator": psutil.Process()}
    processes |= {f"agent {a.layer_start}:{a.layer_end}": psutil.Process(a.process.pid) for a in swarm.agents}
    mem = {name: {"after_load": memory(process.pid)} for name, process in processes.items()}
    rows = []
    async with Coordinator(
        MODEL,
        specs,
        job=job,
        topology=topology,
        transport=WanProfile.parse(swarm.wan).transport(),
        coordinator_key=swarm.coordinator_key(job),
    ) as coordinator:
        meter = FrameMeter(coordinator.pipeline)
        meter.install()
        # Opens the ring's links between agents and pages every stage's weights in.
        await coordinator.generate(coordinator.request(PROMPTS[0], chat=True, max_tokens=4))
        for name, process in processes.items():
            mem[name]["after_warmup"] = memory(process.pid)
        for count in streams:
            row = await measure(coordinator, meter, processes, PROMPTS[:count], max_tokens, expected[:count])
            rows.append({"rtt_ms": rtt, "topology": topology, **row})
            print(format_row(rows[-1], None, None), flush=True)
    for name, process in processes.items():
        mem[name]["after_runs"] = memory(process.pid)
    chosen = {f"agent {a.layer_start}:{a.layer_end}": agent_kernels(a.log_path) for a in swarm.agents}
    return rows, {"rtt_ms": rtt, "topology": topology, "processes": mem, "kernels": chosen}


def agent_kernels(log_path: Path) -> list[str]:
    """What an agent logged of its kernel choice: one line per weight shape, each row count's
    kernel with every candidate's median microseconds (``kernels.KernelTable.tune``)."""
    lines = log_path.read_text().splitlines()
    return [line.removeprefix("[kernels] ") for line in lines if line.startswith("[kernels]")]


def weights_mb(folder: Path, spans: list[tuple[int, int]]) -> dict[str, float]:
    """fp32 bytes each process needs, from the checkpoint's header: the coordinator's embeddings and
    final norm, each agent's layers, and the whole model for the reference."""
    sizes: dict[str, int] = {}
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        names = handle.keys()
        for key in names:
            sizes[key] = 4 * int(torch.Size(handle.get_slice(key).get_shape()).numel())

    def layer(key: str) -> int | None:
        parts = key.split(".")  # model.layers.{index}.…
        return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None

    weights = {
        f"agent {a}:{b}": sum(n for k, n in sizes.items() if (i := layer(k)) is not None and a <= i < b)
        for a, b in spans
    }
    weights["coordinator"] = sum(n for k, n in sizes.items() if layer(k) is None)
    weights["reference"] = sum(sizes.values())
    return {name: round(n / MB, 1) for name, n in weights.items()}


# --- output ---------------------------------------------------------------------------------------

HEADER = (
    f"{'rtt_ms':>6} {'topo':>4} {'streams':>7} {'agg tok/s':>9} {'stream tok/s':>12} {'x ref':>6} {'x 1-str':>7} "
    f"{'ttft s':>7} {'B/tok/hop':>9} {'rows/frame':>10} {'cpu':>5} {'=ref':>5}"
)
LEGEND = """\
agg tok/s    sum over streams of (tokens - 1) / (earliest first token .. latest last token)
stream tok/s mean over streams of (tokens - 1) / (its first token .. its last token)
x ref        agg tok/s / the reference's decode tok/s;  x 1-str: / agg tok/s of 1 stream at the same RTT
ttft s       request to first token, mean over streams (OPEN round trip and prefill included)
B/tok/hop    decode frames' codec bytes + WebSocket header, per token row per hop (TCP/IP not counted)
rows/frame   token rows per decode frame: how many streams' steps the coordinator sent in one frame
cpu          CPU time of the coordinator and the 3 agents / (wall time x CPUs) during the row
=ref         streams whose greedy tokens equal the reference's"""


def format_row(row: dict, reference_rate: float | None, single: float | None) -> str:
    def ratio(value: float | None) -> str:
        return f"{row['aggregate_tok_s'] / value:.2f}" if value else "-"

    return (
        f"{row['rtt_ms']:>6} {row['topology']:>4} {row['streams']:>7} {row['aggregate_tok_s']:>9.2f} "
        f"{row['per_stream_tok_s']:>12.2f} {ratio(reference_rate):>6} {ratio(single):>7} {row['ttft_s']:>7.3f} "
        f"{row['bytes_per_token_hop'] or 0:>9.1f} {row['rows_per_decode_frame'] or 0:>10.2f} "
        f"{row['cpu_busy']:>5.0%} {row['tokens_equal_reference']:>3}/{row['streams']}"
    )


def find(rows: list[dict], rtt: int, streams: int, topology: str = "ring") -> dict | None:
    return next((r for r in rows if (r["rtt_ms"], r["streams"], r["topology"]) == (rtt, streams, topology)), None)


def targets(rows: list[dict], reference: dict, limit: int) -> list[dict]:
    def check(name: str, value: float | None, relation: str, goal: float) -> dict:
        met = None if value is None else value <= goal if relation == "<=" else value >= goal
        return {"target": name, "value": value, "relation": relation, "goal": goal, "met": met}

    reference_rate = reference["decode_tok_s"]
    single0 = find(rows, 0, 1)
    single200, three200 = find(rows, 200, 1), find(rows, 200, 3)
    hops = [r["bytes_per_token_hop"] for r in rows if r["bytes_per_token_hop"] is not None]
    return [
        check(
            "single-stream throughput at 0 ms / reference with Hugging Face's products",
            single0 and round(single0["aggregate_tok_s"] / reference_rate, 3),
            ">=",
            0.9,
        ),
        check(
            "single-stream throughput at 0 ms / reference with the same products",
            single0 and round(single0["aggregate_tok_s"] / reference["same_products"]["decode_tok_s"], 3),
            ">=",
            0.95,
        ),
        check(
            "3 streams / 1 stream aggregate throughput at 200 ms",
            single200 and three200 and round(three200["aggregate_tok_s"] / single200["aggregate_tok_s"], 3),
            ">=",
            2.4,
        ),
        check(
            "wire bytes per token per hop (max over rows), hidden x 4 + 256", max(hops) if hops else None, "<=", limit
        ),
    ]


def print_summary(rows: list[dict], ref: dict, swarms: list[dict], weights: dict[str, float], checks: list[dict]):
    print("\nsummary (ratios from this run)")
    print(HEADER)
    for row in rows:
        single = find(rows, row["rtt_ms"], 1, row["topology"])
        print(format_row(row, ref["decode_tok_s"], single["aggregate_tok_s"] if single else None))
    print(LEGEND)

    def mem(entry: dict) -> str:
        return f"{entry['rss_mb']:>6.1f} MB ({entry['checkpoint_mapped_mb']:>5.1f}; USS {entry['uss_mb']:>5.1f})"

    ref_mem = ref["memory"]
    print(
        "\nresident memory: RSS (of which checkpoint file pages still mapped; USS: pages no other process maps). "
        "Each process copies\nthe weights it loads into memory of its own, so 'after load' already holds them."
    )
    print(f"{'process':<28} {'after load':>30} {'after warm-up':>30} {'after runs':>30}  weights it needs")
    print(
        f"{'reference (whole model)':<28} {mem(ref_mem['after_load']):>30} {'':>30} {mem(ref_mem['after_runs']):>30}"
        f"  {weights['reference']:.1f} MB (imports alone: {ref_mem['after_imports']['rss_mb']} MB RSS)"
    )
    for swarm in swarms:
        for name, entry in swarm["processes"].items():
            label = f"{name} ({swarm['topology']} {swarm['rtt_ms']} ms)"
            print(
                f"{label:<28} {mem(entry['after_load']):>30} {mem(entry['after_warmup']):>30} "
                f"{mem(entry['after_runs']):>30}  {weights[name]:.1f} MB"
            )
    print()
    for check in checks:
        verdict = "n/a" if check["met"] is None else "PASS" if check["met"] else "MISS"
        print(f"target {check['target']}: {check['value']} (goal {check['relation']} {check['goal']}) {verdict}")
    equal = sum(r["tokens_equal_reference"] for r in rows)
    print(f"greedy tokens equal to the reference's in {equal} of {sum(r['streams'] for r in rows)} streams")


def machine(threads: int) -> dict:
    import transformers

    return describe_machine(
        memory_gb=round(psutil.virtual_memory().total / 1024**3, 1),
        torch=torch.__version__,
        transformers=transformers.__version__,
        torch_threads_per_agent_and_coordinator=threads,
        load_average_at_start=load_average(),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per stream (default 64)")
    parser.add_argument("--rtts", default="0,50,200", help="emulated round trips in ms (default 0,50,200)")
    parser.add_argument("--streams", default="1,2,3,6", help="concurrent streams (default 1,2,3,6)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of each agent and of the coordinator (default 1)"
    )
    parser.add_argument(
        "--reference-threads",
        default="1,2",
        help="torch thread counts tried for the reference; the fastest counts (default 1,2)",
    )
    parser.add_argument(
        "--star-rtt", type=int, default=50, help="also run 1 stream in star topology at this RTT; -1 skips it"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 tokens, 0 and 50 ms, 1 and 2 streams")
    parser.add_argument("--output", type=Path, default=RESULTS, help="default bench/results/pipeline.json")
    parser.add_argument("--reference-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.max_tokens, args.rtts, args.streams = 8, "0,50", "1,2"
    args.rtts = [int(x) for x in args.rtts.split(",")]
    args.streams = [int(x) for x in args.streams.split(",")]
    args.reference_threads = [int(x) for x in args.reference_threads.split(",")]
    if max(args.streams) > len(PROMPTS):
        parser.error(f"at most {len(PROMPTS)} streams")
    return args


def main() -> int:
    args = parse_args()
    if args.reference_child:
        print(json.dumps(reference(json.loads(args.prompts), args.max_tokens, args.reference_threads)))
        return 0
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    info = machine(args.threads)
    config = models.load_config(MODEL)
    hidden = int(config.hidden_size)
    print(
        f"machine: {info['cpu']}, {info['cpu_count']} CPUs, torch {info['torch']}, "
        f"load average {info['load_average_at_start']}\n"
        f"model {MODEL}: {config.num_hidden_layers} layers, hidden {hidden}; stages {SPANS}; ring topology; "
        f"{args.threads} torch thread(s) per agent and for the coordinator; {args.max_tokens} new tokens per "
        "stream at most, greedy",
        flush=True,
    )

    prompts = PROMPTS[: max(args.streams)]
    ref = run_reference_process(prompts, args.max_tokens, args.reference_threads)
    expected = [run["token_ids"] for run in ref["runs"]]
    tried = ", ".join(f"{r['decode_tok_s']:.2f} with {t} thread(s)" for t, r in ref["by_threads"].items())
    print(
        f"reference, HF generate in one process: decode tok/s {tried}; counts {ref['decode_tok_s']:.2f}; "
        f"ttft {ref['ttft_s']:.3f} s; {len(expected[0])} tokens; with the products timed here "
        f"{ref['same_products']['decode_tok_s']:.2f} (same tokens: {ref['same_products']['tokens_equal']})\n",
        flush=True,
    )
    print(HEADER, flush=True)

    folder = models.resolve_checkpoint(MODEL)
    models.load_head(MODEL)  # cached: every Coordinator of this run shares it
    rows: list[dict] = []
    swarms: list[dict] = []
    plan = [(rtt, "ring", args.streams) for rtt in args.rtts]
    if args.star_rtt >= 0:
        plan.append((args.star_rtt, "star", [1]))
    for rtt, topology, counts in plan:
        with LocalSwarm(MODEL, SPANS, threads=args.threads, wan=f"rtt={rtt}ms" if rtt else "") as swarm:
            swarm_rows, swarm_memory = asyncio.run(run_swarm(swarm, rtt, topology, counts, args.max_tokens, expected))
        rows += swarm_rows
        swarms.append(swarm_memory)

    weights = weights_mb(folder, SPANS)
    checks = targets(rows, ref, hidden * 4 + 256)
    print_summary(rows, ref, swarms, weights, checks)
    elapsed = round(time.monotonic() - started, 1)
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report = {
        "benchmark": "pipeline",
        "command": " ".join(["python", "bench/pipeline.py", *sys.argv[1:]]),
        "machine": info,
        "conditions": {
            "model": MODEL,
            "stages": [f"{a}:{b}" for a, b in SPANS],
            "hidden_size": hidden,
            "wire_dtype": "f32",
            "max_new_tokens": args.max_tokens,
            "greedy": True,
            "rtts_ms": args.rtts,
            "streams": args.streams,
            "topology": "ring" + (f", plus 1 stream in star at {args.star_rtt} ms" if args.star_rtt >= 0 else ""),
            "wan": "every process delays its own outgoing frames by rtt/2 (one-way latency on every link)",
            "prompts": prompts,
            "definitions": {line[:12].strip(): line[13:] for line in LEGEND.splitlines()},
        },
        "reference": ref,
        "kernels": {
            "coordinator": kernels.TABLE.choices(),
            "agents": swarms[0]["kernels"] if swarms else {},
            "reference_same_products": ref["same_products"]["kernels"],
        },
        "rows": rows,
        "memory_mb": {"reference": ref["memory"], "swarms": swarms, "layer_weights": weights},
        "targets": checks,
        "elapsed_s": elapsed,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.output, report)
    print(f"\nwrote {args.output} in {elapsed} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
