"""Speculative decoding against plain decoding over emulated WAN round trips.

    .venv/bin/python bench/speculative.py            # the full run (``make bench``), about 40 minutes
    .venv/bin/python bench/speculative.py --quick    # a smoke run of the same code paths

In one run, on smollm2-135m split into three ``swarm-worker serve`` processes on loopback
(layers 0:10, 10:20, 20:30), ring topology, greedy, for each round trip in ``--rtts``: the
application's WAN emulator delays every link (coordinator -> A -> B -> C -> coordinator) by half
the round trip, so one pass through the ring takes two round trips plus compute. For each round
trip, two coordinators in this process, one decoding plainly (one token per pass) and one with
speculation as the product runs it by default (``SpeculationSettings()``: the n-gram drafter, a
router choosing K and the chunks in flight per chain), each serve

- draftable prompts (up to ``--max-tokens`` 160 each; the answers end sooner): repeat a passage
  (about 125 tokens), rewrite a class with an attribute renamed, repeat two paragraphs that
  differ in two words, copy a list: text the answer repeats, which a prompt-lookup drafter can
  propose;
- novel chat (``--novel-max-tokens`` 64 each): open questions whose answers repeat little of
  the prompt;

with 1 stream (each prompt of the set alone, one after another) and with 4 concurrent streams
(the set's four prompts in one coordinator job). The two coordinators take turns on every
prompt (one stream) or group (four), so a comparison is between runs seconds apart.

Per row: decode tokens/s (the sum of (tokens - 1) over the streams, divided by the time from the
earliest first token to the latest last token; with one stream, summed over the prompts run in
turn), the ratio to plain decoding at the same round trip, prompt set and stream count,
acceptance (drafts accepted / drafts verified), committed tokens per forward pass, wasted
positions (positions the stages computed, from their signed receipts, minus the positions plain
decoding computes for the same tokens) and whether every stream's tokens equal plain decoding's.
The router's choices (plans per chain) are kept per row, and with one stream each prompt's own
figures.

The drafter is the model-free n-gram (prompt lookup): no draft model sharing SmolLM2's tokenizer
exists offline on this machine (the registry's other models, tiny-llama and its seeds, are random
weights whose drafts would almost never be accepted), so ``--draft-model`` is left off here; the
draft-model path is exercised by the tests with tiny-llama pairs.

A benchmark measures and prints; it asserts nothing. The table goes to stdout, everything else
to ``bench/results/speculative.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import sys
import time
from pathlib import Path

from report import describe_machine, load_average, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's packages, whatever the venv's editable install points at

from worker_agent.coordinator.job import Coordinator, GenerationResult  # noqa: E402
from worker_agent.coordinator.pipeline import StageSpec  # noqa: E402
from worker_agent.coordinator.session import TokenEvent  # noqa: E402
from worker_agent.coordinator.speculation import SpeculationSettings  # noqa: E402
from worker_agent.dev.local import LocalSwarm  # noqa: E402
from worker_agent.dev.wan import WanProfile  # noqa: E402

MODEL = "smollm2-135m"
SPANS = [(0, 10), (10, 20), (20, 30)]
RESULTS = ROOT / "bench" / "results" / "speculative.json"
TICKET_TTL_S = 4 * 3600

PASSAGE = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
    "once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations "
    "in it, and what is the use of a book, thought Alice, without pictures or conversations? So she was "
    "considering in her own mind, as well as she could, for the hot day made her feel very sleepy and stupid, "
    "whether the pleasure of making a daisy-chain would be worth the trouble of getting up and picking the "
    "daisies, when suddenly a White Rabbit with pink eyes ran close by her."
)
CODE = (
    "class ShoppingCart:\n"
    "    def __init__(self, customer):\n"
    "        self.customer = customer\n"
    "        self.items = []\n"
    "\n"
    "    def add(self, name, price, quantity=1):\n"
    '        self.items.append({"name": name, "price": price, "quantity": quantity})\n'
    "\n"
    "    def remove(self, name):\n"
    '        self.items = [item for item in self.items if item["name"] != name]\n'
    "\n"
    "    def subtotal(self):\n"
    '        return sum(item["price"] * item["quantity"] for item in self.items)\n'
    "\n"
    "    def total(self, tax_rate):\n"
    "        subtotal = self.subtotal()\n"
    "        return subtotal + subtotal * tax_rate\n"
)
MINUTES = (
    "The committee met on Monday to review the budget. The committee agreed that the budget for the library "
    "would stay the same, and that the budget for the park would grow by ten percent. The committee will meet "
    "again on Friday."
)
# Text the answer repeats or lightly edits. SmolLM2-135M copies a passage of about 125 tokens
# verbatim but not one of about 300: asked to repeat the 300-token passage, it paraphrases
# and then loops (2.2 tokens per synchronous pass with ideal prompt lookup), so the passages here
# are the longest it still repeats. Asked to rename a variable it copies the code unrenamed: that
# is the answer greedy decoding gives, and the row measures it as it is.
DRAFTABLE = [
    f"Repeat the following paragraph exactly:\n\n{PASSAGE}",
    f"Rewrite this Python class with the attribute `items` renamed to `products`. Output only the code.\n\n{CODE}",
    f"Repeat the following paragraph exactly:\n\n{MINUTES} "
    + MINUTES.replace("Monday", "Tuesday").replace("Friday", "Saturday"),
    "Copy this list exactly:\n1. Preheat the oven to 180 degrees.\n2. Mix the flour, sugar and eggs in a bowl.\n"
    "3. Pour the batter into a greased tin.\n4. Bake for thirty minutes.\n5. Let the cake cool before serving.",
]
NOVEL = [
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me some ideas for a weekend trip in the mountains.",
    "How does a bicycle stay upright when it moves?",
]


def ring_wan(rtt_ms: int) -> str:
    return f"rtt={rtt_ms}ms" if rtt_ms else ""


async def timed(coordinator: Coordinator, prompt: str, max_tokens: int) -> tuple[list[float], GenerationResult]:
    request = coordinator.request(prompt, chat=True, max_tokens=max_tokens)
    times: list[float] = []
    result = None
    async for event in coordinator.stream(request):
        if isinstance(event, TokenEvent):
            if event.token_id is not None:
                times.append(time.perf_counter())
        else:
            result = event
    assert result is not None
    return times, result


def plain_positions(result: GenerationResult) -> int:
    """Positions plain decoding computes for the same tokens: the prompt, then every generated token
    but the last, and that one too when an EOS (not a generated token) followed it."""
    at_eos = result.finish_reason == "stop"
    return result.prompt_tokens + len(result.token_ids) - (0 if at_eos else 1)


async def run_group(coordinator: Coordinator, prompts: list[str], max_tokens: int) -> dict:
    """``prompts`` as concurrent streams of one job: their decode tokens, the window they span
    (earliest first token to latest last token) and their results."""
    runs = await asyncio.gather(*(timed(coordinator, prompt, max_tokens) for prompt in prompts))
    firsts = [times[0] for times, _ in runs if times]
    lasts = [times[-1] for times, _ in runs if times]
    return {
        "decode": sum(max(0, len(times) - 1) for times, _ in runs),
        "window": max(lasts) - min(firsts) if firsts else 0.0,
        "results": [result for _, result in runs],
    }


def summarize(groups: list[dict], streams: int) -> dict:
    """One row from groups run one after another (each prompt alone for one stream, all of them
    at once for several): tok/s is their decode tokens over the sum of their windows."""
    decode = sum(group["decode"] for group in groups)
    window = sum(group["window"] for group in groups)
    results = [result for group in groups for result in group["results"]]
    drafted = sum(r.drafted for r in results)
    accepted = sum(r.accepted for r in results)
    computed = sum(r.receipts[0].tokens for r in results if r.receipts)
    plans: dict[str, int] = {}
    for result in results:
        for name, count in result.speculation.get("plans", {}).items():
            plans[name] = plans.get(name, 0) + count
    row = {
        "streams": streams,
        "completion_tokens": [len(r.token_ids) for r in results],
        "tok_s": round(decode / window, 2) if window > 0 else None,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(accepted / drafted, 4) if drafted else None,
        "tokens_per_pass": round(sum(len(r.token_ids) for r in results) / sum(r.steps for r in results), 3),
        "wasted_positions": computed - sum(plain_positions(r) for r in results),
        "verified": all(r.verification is not None for r in results),
        "plans": plans,
        "token_ids": [r.token_ids for r in results],
    }
    if streams == 1:
        row["per_prompt"] = [
            {
                "tokens": len(r.token_ids),
                "tok_s": round(group["decode"] / group["window"], 2) if group["window"] > 0 else None,
                "acceptance": round(r.accepted / r.drafted, 4) if r.drafted else None,
                "tokens_per_pass": round(len(r.token_ids) / r.steps, 3) if r.steps else None,
            }
            for group in groups
            for r in group["results"]
        ]
    return row


async def run_rtt(swarm: LocalSwarm, rtt: int, modes: dict[str, SpeculationSettings], args) -> list[dict]:
    """Every row of one round trip. The modes' coordinators are all open at once and take turns on
    each group of prompts (with one stream, each prompt alone in turn), so a comparison is between
    runs seconds apart."""
    async with contextlib.AsyncExitStack() as stack:
        coordinators = {}
        for mode, settings in modes.items():
            job = f"bench-spec-{mode}-rtt{rtt}"
            # A coordinator serves every row of its round trip: at 300 ms that is most of an hour.
            tickets = swarm.tickets(job, ttl_s=TICKET_TTL_S)
            specs = [StageSpec(url, ticket) for url, ticket in zip(swarm.urls, tickets, strict=True)]
            coordinator = await stack.enter_async_context(
                Coordinator(
                    MODEL,
                    specs,
                    job=job,
                    transport=WanProfile.parse(ring_wan(rtt)).transport(),
                    coordinator_key=swarm.coordinator_key(job),
                    speculation=settings,
                )
            )
            await coordinator.generate(coordinator.request(NOVEL[0], chat=True, max_tokens=2))  # warm the links
            coordinators[mode] = coordinator
        rows = []
        sets = {"draftable": (DRAFTABLE, args.max_tokens), "novel": (NOVEL, args.novel_max_tokens)}
        for name in args.prompts:
            prompts, max_tokens = sets[name]
            for streams in args.streams:
                groups = [[prompt] for prompt in prompts] if streams == 1 else [prompts[:streams]]
                collected: dict[str, list[dict]] = {mode: [] for mode in coordinators}
                for group in groups:
                    for mode, coordinator in coordinators.items():
                        collected[mode].append(await run_group(coordinator, group, max_tokens))
                for mode in coordinators:
                    row = {"rtt_ms": rtt, "mode": mode, "prompts": name} | summarize(collected[mode], streams)
                    rows.append(row)
                    print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
    return (
        f"{row['rtt_ms']:>5} {row['mode']:<8} {row['prompts']:<10} {row['streams']:>2} {row['tok_s'] or 0:>8.2f} "
        f"{acceptance:>6} {row['tokens_per_pass']:>6.2f} {row['wasted_positions']:>7}"
    )


def compare(rows: list[dict]) -> list[dict]:
    """Each speculative row against plain decoding at the same round trip, prompts and streams."""
    plain = {(r["rtt_ms"], r["prompts"], r["streams"]): r for r in rows if r["mode"] == "plain"}
    out = []
    for row in rows:
        base = plain.get((row["rtt_ms"], row["prompts"], row["streams"]))
        if row["mode"] == "plain" or base is None:
            continue
        out.append(
            {
                "rtt_ms": row["rtt_ms"],
                "mode": row["mode"],
                "prompts": row["prompts"],
                "streams": row["streams"],
                "plain_tok_s": base["tok_s"],
                "tok_s": row["tok_s"],
                "ratio": round(row["tok_s"] / base["tok_s"], 2) if row["tok_s"] and base["tok_s"] else None,
                "acceptance": row["acceptance"],
                "tokens_per_pass": row["tokens_per_pass"],
                "wasted_positions": row["wasted_positions"],
                "identical": row["token_ids"] == base["token_ids"],
                "plans": row["plans"],
            }
        )
        if "per_prompt" in row:
            out[-1]["per_prompt_ratio"] = [
                round(mine["tok_s"] / theirs["tok_s"], 2) if mine["tok_s"] and theirs["tok_s"] else None
                for mine, theirs in zip(row["per_prompt"], base["per_prompt"], strict=True)
            ]
    return out


def print_summary(comparisons: list[dict]) -> None:
    print(
        f"\n{'RTT ms':>6} {'prompts':<10} {'streams':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
        f"{'accept':>6} {'tok/pass':>8} {'wasted':>6} {'identical':>9}  router's plans (chains)"
    )
    for c in comparisons:
        acceptance = "-" if c["acceptance"] is None else f"{c['acceptance']:.2f}"
        plans = ", ".join(f"{name}: {count}" for name, count in list(c["plans"].items())[:3])
        print(
            f"{c['rtt_ms']:>6} {c['prompts']:<10} {c['streams']:>7} {c['plain_tok_s'] or 0:>11.2f} "
            f"{c['tok_s'] or 0:>10.2f} {c['ratio'] or 0:>6.2f} {acceptance:>6} {c['tokens_per_pass']:>8.2f} "
            f"{c['wasted_positions']:>6} {'yes' if c['identical'] else 'NO':>9}  {plans}"
        )
        if "per_prompt_ratio" in c:
            print(f"{'':>6} each prompt alone: ratios {c['per_prompt_ratio']}")
    print(
        "ratio: speculative / plain decode tok/s at the same round trip (every link delayed by half of it); "
        "drafter: n-gram prompt lookup (no offline draft model shares SmolLM2's tokenizer)"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtts", type=int, nargs="+", default=[0, 50, 200, 300], help="round trips per link, ms")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=160, help="per draftable stream (they end sooner)")
    parser.add_argument("--prompts", nargs="+", choices=["draftable", "novel"], default=["draftable", "novel"])
    parser.add_argument("--novel-max-tokens", type=int, default=64, help="per novel chat stream")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per agent and coordinator")
    parser.add_argument("--fixed", default="", help="also run one fixed plan, e.g. 'ngram,8,4' (drafter, K, depth)")
    parser.add_argument("--quick", action="store_true", help="0 and 200 ms, 1 stream, 16 tokens")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.rtts, args.streams, args.max_tokens, args.novel_max_tokens = [0, 200], [1], 16, 16
    return args


def write_report(args: argparse.Namespace, rows: list[dict], load: list[float], started: float, *, final: bool) -> None:
    import torch

    report = {
        "benchmark": "speculative",
        "command": " ".join(["python", "bench/speculative.py", *sys.argv[1:]]),
        "complete": final,
        "machine": describe_machine(
            platform=platform.platform(),
            torch=torch.__version__,
            threads=args.threads,
            load_average_at_start=load,
            load_average_at_end=load_average(),
        ),
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "conditions": {
            "wan": "every link of the ring (coordinator -> A -> B -> C -> coordinator) delayed by half the round "
            "trip, in the application (worker_agent/dev/wan.py): one pass takes two round trips plus compute",
            "drafter": "n-gram prompt lookup (ngram: matches of 2-8 tokens; ngram1: a one-token match where "
            "ngram has none); no offline draft model shares SmolLM2's tokenizer",
            "tok_s": "sum of (tokens - 1) over the streams / (latest last token - earliest first token); with one "
            "stream, summed over the prompts run one after another",
            "wasted_positions": "positions the stages signed for minus the positions plain decoding computes",
        },
        "rows": [{k: v for k, v in row.items() if k != "token_ids"} for row in rows],
        "comparisons": compare(rows),
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    write_json(args.output, report)


def main() -> int:
    args = parse_args()
    import torch  # after argparse: --help answers at once

    torch.set_num_threads(args.threads)
    modes = {"plain": SpeculationSettings(enabled=False), "auto": SpeculationSettings()}
    if args.fixed:
        drafter, k, depth = args.fixed.split(",")
        modes["fixed"] = SpeculationSettings(drafter=drafter, k=int(k), depth=int(depth))
    started = time.monotonic()
    load = [round(x, 2) for x in os.getloadavg()]
    print(f"{'RTT':>5} {'mode':<8} {'prompts':<10} {'n':>2} {'tok/s':>8} {'accept':>6} {'tok/pass':>6} {'wasted':>7}")
    rows: list[dict] = []
    for rtt in args.rtts:
        with LocalSwarm(MODEL, SPANS, threads=args.threads, wan=ring_wan(rtt)) as swarm:
            rows += asyncio.run(run_rtt(swarm, rtt, modes, args))
        write_report(args, rows, load, started, final=False)  # what is measured so far survives a crash
    print_summary(compare(rows))
    write_report(args, rows, load, started, final=True)
    print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
