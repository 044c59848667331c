"""Speculative decoding against plain decoding over emulated WAN round trips, and prefix reuse
in a multi-turn chat.

    .venv/bin/python bench/speculative.py            # the full run (``make bench``), about 55 minutes
    .venv/bin/python bench/speculative.py --quick    # every code path at 0 and 50 ms, a few tokens
    .venv/bin/python bench/speculative.py --rtts 300 --streams 1 --kinds novel --sampling greedy
    .venv/bin/python bench/speculative.py --kinds multiturn                       # the chat alone

In one run, on smollm2-135m split into three ``swarm-worker serve`` processes on loopback
(layers 0:10, 10:20, 20:30), ring topology, for each round trip in ``--rtts`` (0, 50, 200, 300
ms): the application's WAN emulator delays every link (coordinator -> A -> B -> C -> coordinator)
by half the round trip, so one pass through the ring takes two round trips plus compute. For each
round trip, two coordinators in this process, one decoding plainly (one token per pass) and one
with speculation as the product runs it by default (``SpeculationSettings()``: the n-gram drafter,
a router choosing K and the chunks in flight per chain), take turns on every prompt (one stream)
or group (four streams), so a comparison is between runs seconds apart. The prompts
(``speculative_prompts.py``), by ``--kinds``:

- ``draftable``: short texts the answer repeats or lightly edits (``--max-tokens`` 160; the
  answers end sooner): repeat a paragraph of about 60 words, rewrite a class with an attribute
  renamed, repeat two paragraphs that differ in one word, copy a list;
- ``long``: repeat passages of over 300 tokens (``--long-max-tokens`` 400): a thirty-step recipe
  of about 340 tokens, which SmolLM2-135M copies exactly, and the story's opening paragraphs
  (about 330 tokens), which it copies with one paragraph left out, then starts over from the third
  and runs to the budget; each prompt's own ratio is printed;
- ``novel``: open questions whose answers repeat little of the prompt (``--novel-max-tokens`` 48);
- ``multiturn``: a chat of about 900 tokens (a system message, the story's opening, an answer,
  a question), then a follow-up whose prompt is that history, the first answer and a new
  question, both through the model's chat template (``--turn-max-tokens`` 32 each).

each with 1 stream (each prompt alone, one after another) and 4 concurrent streams (a set's four
prompts in one coordinator job; ``long`` runs with 1 stream only), greedy and
sampled (``--sampling``; temperature ``--temperature`` 0.8, the seed of the i-th prompt of a set
``--seed`` + i). The grid is trimmed to stay under an hour: sampled rows run at ``--sampled-rtts``
(0 and 300 ms) and the long passage at ``--long-rtts`` (0 and 300 ms), greedy and sampled; the
rest at every round trip.

Per row: decode tokens/s (the sum of (tokens - 1) over the streams, divided by the time from the
earliest first token to the latest last token; with one stream, summed over the prompts run in
turn), the ratio to plain decoding at the same round trip, prompts, stream count and sampling,
acceptance (drafts accepted / drafts verified), committed tokens per forward pass, wasted
positions (positions the stages computed, from their signed receipts, minus the positions plain
decoding computes for the same tokens) and whether every stream's tokens equal plain decoding's
(required of greedy rows; a seeded sampled row draws each position's token from (seed, position)
alone, so it usually matches too, but numerics may flip a draw: its losslessness is what
``tests/test_speculation_sampling.py`` checks, over the distribution). The router's choices (plans
per chain) are kept per row, and with one stream each prompt's own figures.

The multi-turn row (on the speculating coordinator, greedy) runs turn 1 and turn 2 with
``prefix_salt=b"bench"`` (turn 2 may reuse turn 1's prefix) and turn 2 again without a salt (no
reuse): each turn's time to first token, the ratio turn 2 / turn 1, the cached tokens the result
reports and whether turn 2's tokens equal those without reuse. Where ``GenerationRequest`` has no
``prefix_salt`` field (prefix reuse is not in the checkout) the row reports reuse as not
available and times both turns without it.

The full run took about 31 minutes on this 2-core Intel Xeon before the long, sampled and
multi-turn rows; from that run's rates those add about 25 minutes (the plain side of the long
passage at 300 ms alone takes about 4 minutes a sampling), about 55 minutes in all on a quiet
machine. ``--quick`` took about 8 minutes here with the machine loaded by other work.

The drafter is the model-free n-gram (prompt lookup): no draft model sharing SmolLM2's tokenizer
exists offline on this machine (the registry's other models, tiny-llama and its seeds, are random
weights whose drafts would almost never be accepted), so ``--draft-model`` is left off here; the
draft-model path is exercised by the tests with tiny-llama pairs.

A benchmark measures and prints; it asserts nothing. The table and the targets (met or missed)
go to stdout, everything else to ``bench/results/speculative.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import platform
import sys
import time
from pathlib import Path

from report import describe_machine, load_average, write_json
from speculative_prompts import CONVERSATION, DRAFTABLE, FOLLOW_UP, LONG, NOVEL
from speculative_report import compare, format_turns, print_summary, targets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's packages, whatever the venv's editable install points at

from worker_agent.coordinator.drafters import NgramDrafter  # noqa: E402
from worker_agent.coordinator.job import Coordinator, GenerationResult, encode_prompt  # noqa: E402
from worker_agent.coordinator.pipeline import StageSpec  # noqa: E402
from worker_agent.coordinator.sampling import SamplingParams  # noqa: E402
from worker_agent.coordinator.session import GenerationRequest, TokenEvent  # noqa: E402
from worker_agent.coordinator.speculation import SpeculationSettings  # noqa: E402
from worker_agent.dev.local import LocalSwarm  # noqa: E402
from worker_agent.dev.wan import WanProfile  # noqa: E402

MODEL = "smollm2-135m"
SPANS = [(0, 10), (10, 20), (20, 30)]
RESULTS = ROOT / "bench" / "results" / "speculative.json"
TICKET_TTL_S = 4 * 3600
KINDS = ("draftable", "long", "novel", "multiturn")
SAMPLINGS = ("greedy", "sampled")
# Prefix reuse adds ``prefix_salt`` to GenerationRequest; before it, the multi-turn row says so.
PREFIX_REUSE = "prefix_salt" in {f.name for f in dataclasses.fields(GenerationRequest)}
SALT = b"bench"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One comparison of the grid: a prompt set, a stream count and a sampling."""

    kind: str  # draftable, long or novel
    streams: int
    sampling: str  # greedy or sampled


def cells(args: argparse.Namespace, rtt: int) -> list[Cell]:
    """The grid at one round trip: sampled rows only at ``--sampled-rtts``, the long passage
    only at ``--long-rtts`` and with one stream."""
    out = []
    for sampling in args.sampling:
        if sampling == "sampled" and rtt not in args.sampled_rtts:
            continue
        for kind in ("draftable", "long", "novel"):
            if kind not in args.kinds or (kind == "long" and rtt not in args.long_rtts):
                continue
            out += [Cell(kind, streams, sampling) for streams in args.streams if kind != "long" or streams == 1]
    return out


def ring_wan(rtt_ms: int) -> str:
    return f"rtt={rtt_ms}ms" if rtt_ms else ""


async def timed(coordinator: Coordinator, request: GenerationRequest) -> tuple[list[float], GenerationResult]:
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


def lookup_passes(prompt_ids: tuple[int, ...], token_ids: list[int]) -> int:
    """Passes the answer would take with ideal prompt lookup: the product's n-gram drafter with no
    limit on K and every draft checked at once, each pass committing its accepted run and one
    more token. Its tokens per pass bound what any n-gram plan can reach on that answer (with
    one round trip per pass where the network dominates, it bounds the speed-up too)."""
    drafter, done, passes = NgramDrafter(), 0, 0
    while done < len(token_ids):
        context = [*prompt_ids, *token_ids[:done]]
        drafter.observe(context)
        drafts = drafter.propose(context, len(token_ids) - done)
        run = 0
        while run < len(drafts) and drafts[run] == token_ids[done + run]:
            run += 1
        done += run + 1
        passes += 1
    return passes


async def run_group(coordinator: Coordinator, requests: list[GenerationRequest]) -> dict:
    """``requests`` as concurrent streams of one job: their decode tokens, the window they span
    (earliest first token to latest last token), their results and their ideal lookup passes."""
    runs = await asyncio.gather(*(timed(coordinator, request) for request in requests))
    firsts = [times[0] for times, _ in runs if times]
    lasts = [times[-1] for times, _ in runs if times]
    return {
        "decode": sum(max(0, len(times) - 1) for times, _ in runs),
        "window": max(lasts) - min(firsts) if firsts else 0.0,
        "results": [result for _, result in runs],
        "lookup_passes": sum(
            lookup_passes(request.prompt_ids, result.token_ids)
            for request, (_, result) in zip(requests, runs, strict=True)
        ),
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
        "lookup_tokens_per_pass": round(
            sum(len(r.token_ids) for r in results) / max(1, sum(group["lookup_passes"] for group in groups)), 3
        ),
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


def cell_groups(coordinator: Coordinator, cell: Cell, args: argparse.Namespace) -> list[list[GenerationRequest]]:
    """The cell's requests, grouped as they run: each prompt alone (one stream) or the set's first
    ``streams`` prompts at once. The i-th prompt of a set samples with seed ``--seed`` + i."""
    prompts, max_tokens = {
        "draftable": (DRAFTABLE, args.max_tokens),
        "long": (LONG, args.long_max_tokens),
        "novel": (NOVEL, args.novel_max_tokens),
    }[cell.kind]
    requests = [
        coordinator.request(
            prompt,
            chat=True,
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=args.temperature, seed=args.seed + i)
            if cell.sampling == "sampled"
            else SamplingParams(),
        )
        for i, prompt in enumerate(prompts)
    ]
    return [[request] for request in requests] if cell.streams == 1 else [requests[: cell.streams]]


async def multiturn(coordinator: Coordinator, rtt: int, args: argparse.Namespace) -> dict:
    """The two turns of the chat, turn 2 with and without prefix reuse (see the docstring)."""
    messages = list(CONVERSATION)

    def turn(history: list[dict]) -> GenerationRequest:
        ids = encode_prompt(coordinator.tokenizer, history, chat=True)
        return coordinator.request_ids(ids, max_tokens=args.turn_max_tokens)

    def salted(request: GenerationRequest) -> GenerationRequest:
        return dataclasses.replace(request, prefix_salt=SALT) if PREFIX_REUSE else request

    first_request = turn(messages)
    first = await coordinator.generate(salted(first_request))
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": FOLLOW_UP}]
    second_request = turn(messages)
    second = await coordinator.generate(salted(second_request)) if PREFIX_REUSE else None
    fresh = await coordinator.generate(second_request)
    # The tokens turn 2's prompt shares with turn 1's prompt and answer: what a reuse could cover
    # (the answer's text, tokenized again in the template, may split differently).
    before = (*first_request.prompt_ids, *first.token_ids)
    shared = next(
        (i for i, (a, b) in enumerate(zip(before, second_request.prompt_ids, strict=False)) if a != b),
        min(len(before), len(second_request.prompt_ids)),
    )
    row = {
        "rtt_ms": rtt,
        "prefix_reuse": PREFIX_REUSE,
        "turn1_prompt_tokens": first.prompt_tokens,
        "turn2_prompt_tokens": fresh.prompt_tokens,
        "turn2_shared_prefix_tokens": shared,
        "turn1_ttft_s": first.ttft and round(first.ttft, 4),
        "turn1_cached_tokens": getattr(first, "cached_tokens", None),
        "turn2_no_reuse_ttft_s": fresh.ttft and round(fresh.ttft, 4),
        "turn2_no_reuse_cached_tokens": getattr(fresh, "cached_tokens", None),
        "turn2_ttft_s": None,
        "turn2_cached_tokens": None,
        "turn2_over_turn1": None,
        "turn2_over_no_reuse": None,
        "identical": None,
    }
    if second is not None:
        row |= {
            "turn2_ttft_s": second.ttft and round(second.ttft, 4),
            "turn2_cached_tokens": getattr(second, "cached_tokens", None),
            "turn2_over_turn1": round(second.ttft / first.ttft, 3) if second.ttft and first.ttft else None,
            "turn2_over_no_reuse": round(second.ttft / fresh.ttft, 3) if second.ttft and fresh.ttft else None,
            "identical": second.token_ids == fresh.token_ids,
        }
    print(format_turns(row), flush=True)
    return row


async def run_rtt(
    swarm: LocalSwarm, rtt: int, modes: dict[str, SpeculationSettings], args: argparse.Namespace
) -> tuple[list[dict], list[dict]]:
    """Every row of one round trip, then its multi-turn row. The modes' coordinators are all open
    at once and take turns on each group of prompts, so a comparison is between runs seconds apart."""
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
        for cell in cells(args, rtt):
            collected: dict[str, list[dict]] = {mode: [] for mode in coordinators}
            groups = cell_groups(coordinators["plain"], cell, args)  # a request is the same on any of them
            for index, group in enumerate(groups * args.repeats):
                # The modes take turns in alternating order: what one run leaves the stages doing
                # (closing its sessions, collecting garbage) falls on each mode alike.
                order = list(coordinators.items())
                for mode, coordinator in order[::-1] if index % 2 else order:
                    collected[mode].append(await run_group(coordinator, group))
            for mode in coordinators:
                row = {"rtt_ms": rtt, "mode": mode, "prompts": cell.kind, "sampling": cell.sampling}
                row |= summarize(collected[mode], cell.streams)
                rows.append(row)
                print(format_row(row), flush=True)
        turns = [await multiturn(coordinators["auto"], rtt, args)] if "multiturn" in args.kinds else []
    return rows, turns


def format_row(row: dict) -> str:
    acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
    return (
        f"{row['rtt_ms']:>5} {row['mode']:<8} {row['prompts']:<10} {row['sampling']:<8} {row['streams']:>2} "
        f"{row['tok_s'] or 0:>8.2f} {acceptance:>6} {row['tokens_per_pass']:>6.2f} {row['wasted_positions']:>7}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtts", type=int, nargs="+", default=[0, 50, 200, 300], help="round trips per link, ms")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="prompt sets to run")
    parser.add_argument("--sampling", nargs="+", choices=SAMPLINGS, default=list(SAMPLINGS))
    parser.add_argument("--sampled-rtts", type=int, nargs="+", default=[0, 300], help="where sampled rows run")
    parser.add_argument("--long-rtts", type=int, nargs="+", default=[0, 300], help="where the long passage runs")
    parser.add_argument("--max-tokens", type=int, default=160, help="per short draftable stream (they end sooner)")
    parser.add_argument("--long-max-tokens", type=int, default=400, help="for the long passages")
    parser.add_argument("--novel-max-tokens", type=int, default=48, help="per novel chat stream")
    parser.add_argument("--turn-max-tokens", type=int, default=32, help="per turn of the multi-turn chat")
    parser.add_argument("--temperature", type=float, default=0.8, help="of the sampled rows")
    parser.add_argument("--seed", type=int, default=1234, help="the sampled rows' i-th prompt uses seed + i")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each group of prompts per mode")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per agent and coordinator")
    parser.add_argument("--fixed", default="", help="also run one fixed plan, e.g. 'ngram,8,4' (drafter, K, depth)")
    parser.add_argument("--quick", action="store_true", help="smoke run: every kind at 0 and 50 ms, few tokens")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.rtts = args.sampled_rtts = args.long_rtts = [0, 50]
        args.max_tokens, args.long_max_tokens, args.novel_max_tokens, args.turn_max_tokens = 16, 24, 16, 8
    return args


def write_report(
    args: argparse.Namespace, rows: list[dict], turns: list[dict], load: list[float], started: float, *, final: bool
) -> None:
    import torch

    comparisons = compare(rows)
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
            "sampled": f"temperature {args.temperature}, seed {args.seed} + the prompt's index in its set",
            "multiturn": "on the speculating coordinator, greedy; turn 1 and turn 2 with prefix_salt, turn 2 again "
            "without; TTFT from the request's start to its first token",
        },
        "prefix_reuse": PREFIX_REUSE,
        "rows": [{k: v for k, v in row.items() if k != "token_ids"} for row in rows],
        "comparisons": comparisons,
        "multiturn": turns,
        "targets": targets(comparisons, turns),
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
    load = load_average()
    print(
        f"{'RTT':>5} {'mode':<8} {'prompts':<10} {'sampling':<8} {'n':>2} {'tok/s':>8} {'accept':>6} "
        f"{'tok/pass':>6} {'wasted':>7}"
    )
    rows: list[dict] = []
    turns: list[dict] = []
    for rtt in args.rtts:
        if not cells(args, rtt) and "multiturn" not in args.kinds:
            continue
        with LocalSwarm(MODEL, SPANS, threads=args.threads, wan=ring_wan(rtt)) as swarm:
            measured, turned = asyncio.run(run_rtt(swarm, rtt, modes, args))
        rows += measured
        turns += turned
        write_report(args, rows, turns, load, started, final=False)  # what is measured so far survives a crash
    comparisons = compare(rows)
    print_summary(comparisons, turns, targets(comparisons, turns), quick=args.quick)
    write_report(args, rows, turns, load, started, final=True)
    print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
