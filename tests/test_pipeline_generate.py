"""End to end: three `swarm-worker serve` processes hold layers 0:10, 10:20, 20:30 of smollm2-135m,
and `swarm-coordinator generate` must produce exactly what single-process greedy `generate` does."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from functools import cache

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker_agent import model as models
from worker_agent.coordinator.job import Coordinator
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.protocol.receipts import Receipt, StageAssignment

pytestmark = pytest.mark.dataplane

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]
MAX_TOKENS = 24


@cache
def reference_model():
    checkpoint = models.resolve_checkpoint("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@cache
def reference_tokens(prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[int, ...]:
    """Greedy tokens of single-process HF `generate`, without the trailing EOS (each prompt's once)."""
    tokenizer = models.load_tokenizer("smollm2-135m")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)["input_ids"]
    with torch.no_grad():
        out = reference_model().generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    tokens = out[0, len(ids) :].tolist()
    return tuple(t for t in tokens if t != tokenizer.eos_token_id)


def run_cli(swarm, *args: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "worker_agent.coordinator.cli",
        "generate",
        "--model",
        "smollm2-135m",
        "--stages",
        ",".join(swarm.urls),
        "--ticket-key",
        str(swarm.workdir / "issuer.key"),
        "--chat",
        "--max-tokens",
        str(MAX_TOKENS),
        "--threads",
        "1",
        "--json",
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("topology", ["ring", "star"])
def test_cli_matches_single_process_generate(smollm2_swarm, topology):
    args = [arg for prompt in PROMPTS for arg in ("--prompt", prompt)]

    report = run_cli(smollm2_swarm, "--topology", topology, "--speculate", "off", *args)

    assert report["topology"] == topology
    assert len(report["results"]) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, report["results"], strict=True):
        expected = reference_tokens(prompt)
        assert result["token_ids"] == list(expected), prompt
        assert result["text"] == models.load_tokenizer("smollm2-135m").decode(expected, skip_special_tokens=True)
        assert result["verified"] is True
        assert result["completion_tokens"] == len(expected)
        assert len(result["token_times"]) == len(expected)
        spans = [(r["layer_start"], r["layer_end"]) for r in result["receipts"]]
        assert spans == [(0, 10), (10, 20), (20, 30)]
        steps = len(expected) if result["finish_reason"] == "length" else len(expected) + 1
        assert [r["steps"] for r in result["receipts"]] == [steps] * 3
        assert [r["tokens"] for r in result["receipts"]] == [result["prompt_tokens"] + steps - 1] * 3


@pytest.mark.parametrize("topology", ["ring", "star"])
def test_cli_speculating_matches_single_process_generate(smollm2_swarm, topology):
    args = [arg for prompt in PROMPTS for arg in ("--prompt", prompt)]

    report = run_cli(smollm2_swarm, "--topology", topology, "--draft", "ngram", "--k", "4", "--depth", "2", *args)

    for prompt, result in zip(PROMPTS, report["results"], strict=True):
        assert result["token_ids"] == list(reference_tokens(prompt)), prompt
        assert result["verified"] is True
        assert result["speculation"]["last_plan"] is not None
    # The chat template repeats itself ("<|im_start|>..."), so some drafts are always checked.
    assert sum(result["drafted"] for result in report["results"]) > 0


def test_capital_of_france_answer(smollm2_swarm):
    report = run_cli(smollm2_swarm, "--prompt", "What is the capital of France?")

    (result,) = report["results"]
    assert result["text"] == "The capital of France is Paris."
    assert result["finish_reason"] == "stop"


def test_concurrent_sessions_match_single_runs_and_verify(smollm2_swarm):
    async def main():
        job = "job-concurrent"
        specs = [
            StageSpec(url, ticket) for url, ticket in zip(smollm2_swarm.urls, smollm2_swarm.tickets(job), strict=True)
        ]
        coordinator_key = smollm2_swarm.coordinator_key(job)
        async with Coordinator(
            "smollm2-135m", specs, job=job, topology="ring", coordinator_key=coordinator_key
        ) as coordinator:
            requests = [coordinator.request(p, chat=True, max_tokens=MAX_TOKENS) for p in PROMPTS * 2]
            return await asyncio.gather(*(coordinator.generate(r) for r in requests)), coordinator.assignments

    results, assignments = asyncio.run(main())

    for prompt, result in zip(PROMPTS * 2, results, strict=True):
        assert result.token_ids == list(reference_tokens(prompt))
        assert result.verification is not None
        assert result.verification.sessions == 1
    nodes = [agent.node for agent in smollm2_swarm.agents]
    assert [a.node for a in assignments] == nodes
    assert all(isinstance(a, StageAssignment) for a in assignments)
    sessions = {r.session for r in results}
    assert len(sessions) == 6


def test_receipts_are_signed_by_the_serving_nodes(smollm2_swarm):
    report = run_cli(smollm2_swarm, "--prompt", PROMPTS[0])

    (result,) = report["results"]
    receipts = result["receipts"]
    assert [r["node"] for r in receipts] == [agent.node for agent in smollm2_swarm.agents]
    assert [bytes.fromhex(r["node_key"]) for r in receipts] == smollm2_swarm.node_keys()
    for raw in receipts:
        assert raw["job"] == report["job"]
        assert raw["model"] == "smollm2-135m"
        assert len(raw["hashes"]) == raw["steps"]
        # The printed receipt is the signed one: rebuilt from its JSON form, its signature verifies.
        receipt = Receipt.from_json(raw)
        receipt.verify_signature()
        assert receipt.node == raw["node"]
