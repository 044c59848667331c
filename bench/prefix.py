"""Prefix reuse: a chat's second turn over a long history, with and without the first turn's KV.

    .venv/bin/python bench/prefix.py              # about 2 minutes on a laptop's CPU
    .venv/bin/python bench/prefix.py --rounds 1   # a smoke run

Three ``swarm-worker serve`` agents hold smollm2-135m (0:10, 10:20, 20:30; one torch thread each).
Each round builds a history of about ``--history`` tokens (a long first user message), runs the
first turn with a fresh account salt (its stages keep its KV), then the second turn (the history,
the first answer and a new question) twice: with the same salt (reusing the kept prefix) and
without one (computing every position), in alternating order. It reports, per mode, the time to
first token (from OPEN to the first token, a fresh ``Coordinator`` per request as a job runs it) and
the positions each stage computed (its receipt's tokens), and checks that both modes gave the same
tokens (greedy). The table goes to stdout, everything else to ``bench/results/prefix.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from pathlib import Path

from worker_agent import model as models
from worker_agent.coordinator.job import Coordinator, GenerationResult
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.dev.local import LocalSwarm

MODEL = "smollm2-135m"
SPANS = [(0, 10), (10, 20), (20, 30)]
MAX_TOKENS = 8
RESULTS = Path(__file__).parent / "results" / "prefix.json"
SENTENCE = "The river ran past the old mill, where the miller counted sacks of grain by lamplight. "


async def _run(swarm: LocalSwarm, ids: list[int], salt: bytes | None) -> GenerationResult:
    job = f"bench-prefix-{uuid.uuid4().hex[:8]}"
    specs = [StageSpec(url, ticket) for url, ticket in zip(swarm.urls, swarm.tickets(job), strict=True)]
    async with Coordinator(MODEL, specs, job=job, coordinator_key=swarm.coordinator_key(job)) as coordinator:
        request = coordinator.request_ids(ids, max_tokens=MAX_TOKENS, speculate=False, prefix_salt=salt)
        return await coordinator.generate(request)


def _prompts(history: int, round_: int) -> tuple[list[int], str]:
    tokenizer = models.load_tokenizer(MODEL)
    words = max(1, history // len(tokenizer(SENTENCE)["input_ids"]))
    text = f"Round {round_}. " + SENTENCE * words + "Summarise the story."
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
    return list(ids), "<|im_end|>\n<|im_start|>user\nWho counted the sacks?<|im_end|>\n<|im_start|>assistant\n"


async def bench(swarm: LocalSwarm, rounds: int, history: int) -> dict:
    tokenizer = models.load_tokenizer(MODEL)
    await _run(swarm, list(range(1, 40)), None)  # warm-up: weights paged in, kernels chosen
    samples: dict[str, list[dict]] = {"reuse": [], "full": []}
    for round_ in range(rounds):
        first_ids, turn = _prompts(history, round_)
        salt = os.urandom(32)
        first = await _run(swarm, first_ids, salt)
        second_ids = first_ids + first.token_ids + list(tokenizer(turn)["input_ids"])
        outputs = {}
        for mode in ("reuse", "full") if round_ % 2 == 0 else ("full", "reuse"):
            started = time.perf_counter()
            result = await _run(swarm, second_ids, salt if mode == "reuse" else None)
            outputs[mode] = result.token_ids
            samples[mode].append(
                {
                    "prompt_tokens": len(second_ids),
                    "cached_tokens": result.cached_tokens,
                    "positions_per_stage": result.receipts[0].tokens,
                    "ttft_s": result.ttft,
                    "elapsed_s": time.perf_counter() - started,
                }
            )
        if outputs["reuse"] != outputs["full"]:
            raise SystemExit(f"round {round_}: the reused run's tokens differ from the full run's")
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--history", type=int, default=1000, help="tokens of the first turn's prompt, about")
    args = parser.parse_args()
    with LocalSwarm(MODEL, SPANS, threads=1) as swarm:
        samples = asyncio.run(bench(swarm, args.rounds, args.history))
    print(f"{'mode':<6} {'prompt':>7} {'cached':>7} {'computed/stage':>15} {'TTFT p50 s':>11}")
    summary = {}
    for mode, rows in samples.items():
        ttft = statistics.median(row["ttft_s"] for row in rows)
        summary[mode] = {"ttft_p50_s": ttft, "rows": rows}
        last = rows[-1]
        counts = f"{last['prompt_tokens']:>7} {last['cached_tokens']:>7} {last['positions_per_stage']:>15}"
        print(f"{mode:<6} {counts} {ttft:>11.3f}")
    ratio = summary["full"]["ttft_p50_s"] / summary["reuse"]["ttft_p50_s"]
    print(f"TTFT full / reuse: {ratio:.2f}x")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"history": args.history, "ratio": ratio, **summary}, indent=2))


if __name__ == "__main__":
    main()
