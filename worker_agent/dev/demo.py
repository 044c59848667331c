"""The data plane alone, ``python -m worker_agent.dev.demo``: three agents serving SmolLM2-135M on
loopback and one request through them, without the control plane (``make demo`` runs the whole marketplace).

It starts three real ``swarm-worker serve`` processes (layers 0:10, 10:20, 20:30), acts as the
ticket issuer for one job, streams a chat answer through the ring pipeline, then prints the
timings and each stage's signed receipt, verified against the transcript.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

from worker_agent.coordinator.job import Coordinator, GenerationResult
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.dev.local import LocalSwarm, even_spans
from worker_agent.model import load_head, load_tokenizer, n_layers, resolve_checkpoint


async def run(swarm: LocalSwarm, model: str, prompt: str, max_tokens: int, topology: str) -> GenerationResult:
    job = f"job-{uuid.uuid4().hex[:12]}"
    specs = [StageSpec(url, ticket) for url, ticket in zip(swarm.urls, swarm.tickets(job), strict=True)]
    async with Coordinator(
        model, specs, job=job, topology=topology, coordinator_key=swarm.coordinator_key(job)
    ) as coordinator:
        print(
            f"\njob {job}, {topology} topology: coordinator -> "
            + " -> ".join(f"{a.node}[{a.layer_start}:{a.layer_end}]" for a in swarm.agents)
            + " -> coordinator"
        )
        print(f"\nuser> {prompt}\nassistant> ", end="", flush=True)
        result = None
        async for event in coordinator.stream(coordinator.request(prompt, chat=True, max_tokens=max_tokens)):
            if isinstance(event, GenerationResult):
                result = event
            else:
                print(event.text, end="", flush=True)
        print()
        assert result is not None
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker_agent.dev.demo", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--topology", choices=["ring", "star"], default="ring")
    parser.add_argument("--workdir", default=".demo", help="keys and agent logs go here")
    args = parser.parse_args(argv)

    print(f"preparing {args.model} (the first run converts the GGUF weights once) ...", flush=True)
    resolve_checkpoint(args.model)
    load_head(args.model)
    load_tokenizer(args.model)
    spans = even_spans(n_layers(args.model), args.stages)
    started = time.monotonic()
    with LocalSwarm(args.model, spans, threads=1, workdir=Path(args.workdir)) as swarm:
        print(f"{len(swarm.agents)} agents ready in {time.monotonic() - started:.1f}s:")
        for agent in swarm.agents:
            print(
                f"  {agent.url}  {agent.node}  layers {agent.layer_start}:{agent.layer_end}  "
                f"pid {agent.process.pid}  log {agent.log_path}"
            )
        result = asyncio.run(run(swarm, args.model, args.prompt, args.max_tokens, args.topology))

    decode = result.token_times[-1] - result.token_times[0] if len(result.token_times) > 1 else 0.0
    rate = (len(result.token_times) - 1) / decode if decode > 0 else 0.0
    print("\ntimings:")
    print(f"  prompt tokens      {result.prompt_tokens}")
    print(f"  completion tokens  {result.completion_tokens} (finish: {result.finish_reason})")
    print(f"  time to first token {result.ttft or 0:.3f} s")
    print(f"  decode             {rate:.1f} tokens/s")
    print(f"  total              {result.elapsed:.2f} s, {result.steps} pipeline steps")
    print("\nreceipts (ed25519-signed by each stage, verified against the coordinator's transcript):")
    for receipt in result.receipts:
        print(
            f"  {receipt.node}  layers {receipt.layer_start:>2}:{receipt.layer_end:<2}  steps {receipt.steps}  "
            f"tokens {receipt.tokens}  chain {receipt.chain_head.hex()[:16]}  sig {receipt.signature.hex()[:16]}"
        )
    verification = result.verification
    assert verification is not None
    print(
        f"  verify_job: OK: {len(result.receipts)} signatures valid, spans tile 0:{n_layers(args.model)}, "
        f"{verification.steps} steps linked stage to stage, endpoints match"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
