"""``swarm-coordinator``: run a generation through a pipeline of agents.

    swarm-coordinator generate --model smollm2-135m \\
        --stages ws://127.0.0.1:7001,ws://127.0.0.1:7002,ws://127.0.0.1:7003 \\
        --ticket-key issuer.key --prompt "What is the capital of France?" --chat --max-tokens 64

With ``--ticket-key`` the coordinator acts as its own ticket issuer (the agents must trust that
key's public half): it makes a fresh coordinator key for the job, signs each stage a ticket naming
it and expiring ``--job-timeout`` seconds (plus a margin) from now, and proves that key in every
HELLO; without it the agents must run with ``--insecure-open``.

``--audit-stage N`` (repeatable) keeps stage N's traffic of every session and, after the run,
replays it through a trusted copy of that stage's layers loaded here; with ``--json`` each
result's ``audits`` entries carry the verdict and the per-token report (``audit.py``).

Speculative decoding is on by default (``--speculate auto``): per chain of chunks a router picks
the drafter, the drafts per chunk K and the chunks in flight from the acceptance it measures and
the round trip it sees, and decodes plainly where speculation does not pay. ``--draft-model``
adds a draft model run here; ``--draft``, ``--k`` and ``--depth`` fix the plan instead::

    swarm-coordinator generate ... --draft ngram --k 8 --depth 4
    swarm-coordinator generate ... --draft-model tiny-llama --draft draft --k 4   # for --model tiny-llama
    swarm-coordinator generate ... --speculate off
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from typing import TYPE_CHECKING

import websockets
from nacl.signing import SigningKey

from worker_agent.errors import SwarmError
from worker_agent.protocol.transport import DirectLink, LinkFactory

if TYPE_CHECKING:
    from worker_agent.coordinator.job import GenerationResult


TICKET_MARGIN_S = 60.0  # a ticket outlives the job's timeout by this much (clock skew, closing)


def local_issuer(key_path: str, job: str, coordinator_key: bytes, expires_at: float):
    """A function that signs a ticket for a stage's identity (its PING info) with a local issuer
    key, naming the job's coordinator key and expiring at ``expires_at`` (unix seconds)."""
    # Imported per command: `--help` answers without loading torch.
    from worker_agent.protocol.keys import load_signing_key
    from worker_agent.protocol.tickets import ticket_for_stage

    key = load_signing_key(key_path)
    return lambda info: ticket_for_stage(key, job, info, coordinator_key=coordinator_key, expires_at=expires_at)


async def local_tickets(urls: list[str], issue) -> list[bytes | None]:
    """Tickets for each stage, signed by ``issue`` (``local_issuer``), for the span each stage
    serves; None for a stage that cannot be reached (connecting to it then fails, and a spare may
    heal it)."""
    # Imported per command: `--help` answers without loading torch.
    from worker_agent.coordinator.heal import probe_stage

    infos = await asyncio.gather(*(probe_stage(url) for url in urls), return_exceptions=True)
    tickets: list[bytes | None] = []
    for url, info in zip(urls, infos, strict=True):
        if isinstance(info, BaseException):
            if not isinstance(info, (OSError, TimeoutError, SwarmError, websockets.WebSocketException)):
                raise info
            print(f"warning: cannot reach {url}: {info}", file=sys.stderr)
            tickets.append(None)
        else:
            tickets.append(issue(info))
    return tickets


async def run_generate(args: argparse.Namespace, transport: LinkFactory = DirectLink) -> int:
    # Imported per command: `--help` answers without loading torch.
    from worker_agent.coordinator.heal import SpareHealer
    from worker_agent.coordinator.job import Coordinator, GenerationResult
    from worker_agent.coordinator.pipeline import StageSpec
    from worker_agent.coordinator.sampling import SamplingParams
    from worker_agent.coordinator.speculation import SpeculationSettings

    urls = [url.strip() for url in args.stages.split(",") if url.strip()]
    job = args.job or f"job-{uuid.uuid4().hex[:16]}"
    coordinator_key = SigningKey.generate() if args.ticket_key else None
    issue = None
    if coordinator_key is not None:
        deadline = time.time() + args.job_timeout + TICKET_MARGIN_S
        issue = local_issuer(args.ticket_key, job, bytes(coordinator_key.verify_key), deadline)
    tickets = await local_tickets(urls, issue) if issue is not None else [None] * len(urls)
    specs = [StageSpec(url, ticket) for url, ticket in zip(urls, tickets, strict=True)]
    spares = [url.strip() for arg in args.spare for url in arg.split(",") if url.strip()]
    healer = SpareHealer(spares, ticket=issue)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    prompts = args.prompt * args.concurrency
    started = time.monotonic()
    async with Coordinator(
        args.model,
        specs,
        job=job,
        topology=args.topology,
        transport=transport,
        audit_stages=args.audit_stage,
        healer=healer if spares else None,
        max_heals=args.max_heals,
        stall_timeout_s=args.stall_timeout,
        coordinator_key=coordinator_key,
        speculation=SpeculationSettings(
            enabled=args.speculate != "off",
            drafter=args.draft,
            k=args.k,
            depth=args.depth,
            draft_model=args.draft_model,
        ),
    ) as coordinator:
        requests = [
            coordinator.request(p, chat=args.chat, max_tokens=args.max_tokens, sampling=sampling, stop=tuple(args.stop))
            for p in prompts
        ]
        streaming = len(requests) == 1 and not args.json

        async def run(request) -> GenerationResult:
            result = None
            async for event in coordinator.stream(request):
                if isinstance(event, GenerationResult):
                    result = event
                elif streaming:
                    print(event.text, end="", flush=True)
            assert result is not None
            return result

        results = await asyncio.gather(*(run(r) for r in requests))
    wall = time.monotonic() - started
    audits = audit_results(args.model, results)
    if args.json:
        reports = []
        for result, audited in zip(results, audits, strict=True):
            report = result.to_json()
            for entry, (verdict, replayed) in zip(report["audits"], audited, strict=True):
                entry.update(verdict=verdict, replay=replayed)
            reports.append(report)
        print(
            json.dumps(
                {"job": job, "topology": args.topology, "wall_s": round(wall, 4), "results": reports},
                indent=2,
            )
        )
        return 0
    for index, result in enumerate(results):
        if not streaming:
            print(f"--- [{index}] {result.text}")
        else:
            print()
        decode = result.token_times[-1] - result.token_times[0] if len(result.token_times) > 1 else 0.0
        rate = (len(result.token_times) - 1) / decode if decode > 0 else 0.0
        print(
            f"[{index}] {result.prompt_tokens} prompt + {result.completion_tokens} completion tokens, "
            f"finish={result.finish_reason}, ttft={result.ttft or 0:.3f}s, decode {rate:.1f} tok/s, "
            f"total {result.elapsed:.2f}s, {result.steps} steps",
            file=sys.stderr,
        )
        if result.drafted:
            print(
                f"    speculation: {result.accepted}/{result.drafted} drafts accepted "
                f"({100 * result.accepted / result.drafted:.0f}%), last plan {result.speculation.get('last_plan')}",
                file=sys.stderr,
            )
        for receipt in result.receipts:
            print(
                f"    receipt node={receipt.node} layers={receipt.layer_start}:{receipt.layer_end} "
                f"steps={receipt.steps} tokens={receipt.tokens} chain={receipt.chain_head.hex()[:16]}... "
                f"signature ok",
                file=sys.stderr,
            )
        print(
            f"[{index}] receipts verified: spans tile 0:{coordinator.n_layers}, links and endpoints match",
            file=sys.stderr,
        )
        for material, (verdict, replayed) in zip(result.audits, audits[index], strict=True):
            worst = f", worst cosine {replayed['worst_cosine']}" if replayed else ""
            print(f"    audit stage {material.stage} node={material.node}: {verdict}{worst}", file=sys.stderr)
    return 0


def audit_results(model: str, results: list[GenerationResult]) -> list[list[tuple[str, dict | None]]]:
    """Per result, each of its audits replayed on a trusted block loaded here: ("passed" or the
    failure's code, the replay's report when there was one)."""
    # Imported per command: `--help` answers without loading torch.
    from worker_agent.block import Block
    from worker_agent.model import load_block
    from worker_agent.protocol.audit import AuditFailed, verify_audit

    blocks: dict[tuple[int, int], Block] = {}
    outcomes = []
    for result in results:
        audited = []
        for material in result.audits:
            receipt = next((r for r in result.receipts if r.node == material.node), None)
            span = (material.layer_start, material.layer_end)
            if span not in blocks:
                blocks[span] = Block(load_block(model, *span))
            try:
                if receipt is None:
                    raise AuditFailed(f"no receipt from node {material.node}")
                report = verify_audit(material, receipt, blocks[span])
            except AuditFailed as exc:
                audited.append((exc.code, exc.report.to_dict() if exc.report else None))
            else:
                audited.append(("passed", report.to_dict()))
        outcomes.append(audited)
    return outcomes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-coordinator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text through a pipeline of agents")
    gen.add_argument("--model", default="smollm2-135m")
    gen.add_argument("--stages", required=True, help="comma-separated ws:// URLs in layer order")
    gen.add_argument("--prompt", action="append", required=True, help="repeatable: one session per prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    gen.add_argument("--topology", choices=["ring", "star"], default="ring")
    gen.add_argument("--concurrency", type=int, default=1, help="run every prompt this many times at once")
    gen.add_argument("--ticket-key", default=None, help="issuer key that signs the job tickets")
    gen.add_argument(
        "--job-timeout",
        type=float,
        default=600.0,
        help="seconds the job may run; its tickets expire this long (plus a minute) after it starts",
    )
    gen.add_argument(
        "--spare",
        action="append",
        default=[],
        metavar="URL",
        help="a warm spare's ws:// URL (repeatable or comma-separated): when a stage dies or stalls, "
        "a spare serving its span takes its place and the request goes on",
    )
    gen.add_argument("--max-heals", type=int, default=2, help="stage failures one request may survive")
    gen.add_argument(
        "--stall-timeout",
        type=float,
        default=10.0,
        help="seconds a step may make no progress before its stage is replaced",
    )
    gen.add_argument("--job", default=None, help="job id (default: random)")
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    gen.add_argument("--json", action="store_true", help="print text, token ids, timings and receipts as JSON")
    gen.add_argument(
        "--speculate",
        choices=["auto", "off"],
        default="auto",
        help="speculative decoding: auto (the router speculates when it pays, per chain) or off (one token per step)",
    )
    gen.add_argument(
        "--draft",
        choices=["ngram", "draft"],
        default=None,
        help="use only this drafter: ngram (prompt lookup) or draft (the --draft-model); default: whichever pays",
    )
    gen.add_argument(
        "--draft-model",
        default=None,
        help="a draft model run here (registry id or checkpoint folder) sharing the target's tokenizer",
    )
    gen.add_argument("--k", type=int, default=None, help="fix the drafts per chunk (0: plain); default: the router's")
    gen.add_argument("--depth", type=int, default=None, help="with --k: chunks in flight per session (default 1)")
    gen.add_argument(
        "--audit-stage",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="keep stage N's traffic and replay it on a trusted local copy of its layers; repeatable",
    )
    return parser


def main(argv: list[str] | None = None, *, transport: LinkFactory = DirectLink) -> int:
    """``transport``: each stage connection's link; the product's unless a test tool's
    (``worker_agent/dev/coordinator.py``)."""
    args = build_parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        return asyncio.run(run_generate(args, transport))
    except (SwarmError, ValueError) as exc:
        code = getattr(exc, "code", "invalid")
        print(f"error: {exc} ({code})", file=sys.stderr)
        return 1
    except (OSError, websockets.WebSocketException) as exc:
        print(f"error: cannot reach a stage: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
