"""One host's side of ``bench/scaleout.py``, run inside the namespace network with the project's
interpreter (``python bench/scaleout_host.py <command> ...``; the control-plane commands take the
control plane's settings from the environment):

- ``setup`` (on ``ops``, after ``migrate``): the ticket and CA keys every control-plane host shares,
  and ``load.py``'s accounts (a provider with three nodes, a customer with a key and credits, the
  model's price); one JSON object to ``--out``.
- ``ready`` (on ``ops``): waits until the model has a servable pipeline whose stages' links were
  probed, unchanged for ``STABLE_S``, and prints it.
- ``client`` (on ``client``): ``--warmup`` streams one after the other, then ``--streams`` at
  once, each a streamed chat completion through the load balancer with an ``Idempotency-Key`` of
  its own, retried with that key after any failure a client may retry (a dropped connection, an
  error event, a 5xx, 409 or 429) until it completes or fails for good. Each attempt's outcome,
  error code, serving web host (``X-Served-By``), request id and timings go to ``--out``; while
  it runs, the count of streams receiving tokens goes to ``--progress``.
- ``report`` (on ``ops``): once every job is settled and audited, each job's end, coordinator host
  and money, and the ledger checked exactly (``ledger``); one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import load  # this folder's; it puts the checkout first on the path

MODEL = "tiny-llama"
STABLE_S = 5.0  # a pipeline unchanged this long (probed links can reorder its ring once) is the run's
RETRYABLE_STATUS = {409, 429}  # besides every 5xx: the key is still answering, or slow down
MAX_ATTEMPTS = 8
RETRY_PAUSE_S = 0.5  # before a stream's first retry, doubling after each
PROGRESS_EVERY_S = 0.2


def django_setup() -> None:
    import django

    django.setup()


# --- setup and ready (ops) --------------------------------------------------------------------


def setup(args: argparse.Namespace) -> int:
    django_setup()
    from marketplace.billing.services import credits
    from marketplace.nodes.authority import authority
    from marketplace.nodes.tickets import issuer_public_key

    issuer_public_key()  # made once here, then copied to every control-plane host's data folder
    authority()
    # bench/load.py's accounts: they read nothing of their topology but its model.
    tokens, key, customer = load.Topology.accounts(SimpleNamespace(args=SimpleNamespace(model=MODEL)))
    answer = {"tokens": tokens, "api_key": key, "customer": customer.pk, "granted_nano": credits(customer)}
    args.out.write_text(json.dumps(answer))
    return 0


def placed_pipeline() -> list[tuple] | None:
    """The model's first servable pipeline, once every stage's links were probed."""
    from marketplace.nodes.models import LinkMeasurement
    from marketplace.placement.selectors import servable_pipelines

    pipelines = servable_pipelines(MODEL)
    if not pipelines:
        return None
    stages = [(s.node, s.data_url, s.layer_start, s.layer_end) for s in pipelines[0]]
    nodes = {stage[0] for stage in stages}
    probed = LinkMeasurement.objects.filter(source__node_id__in=nodes).values_list("source__node_id", flat=True)
    return stages if set(probed) == nodes else None


def ready(args: argparse.Namespace) -> int:
    django_setup()
    deadline = time.monotonic() + args.timeout
    seen, since = None, time.monotonic()
    while time.monotonic() < deadline:
        stages = placed_pipeline()
        if stages != seen:
            seen, since = stages, time.monotonic()
        elif stages is not None and time.monotonic() - since >= STABLE_S:
            print(json.dumps(stages))
            return 0
        time.sleep(0.5)
    print(f"no stable, probed pipeline of {MODEL} in {args.timeout:g}s (last: {seen})", file=sys.stderr)
    return 1


# --- client -----------------------------------------------------------------------------------


class Progress:
    """Streams receiving tokens now, and streams ended, written to a file for the lab to read."""

    def __init__(self, path: Path) -> None:
        self.path, self.flowing, self.ended = path, 0, 0

    async def keep_writing(self) -> None:
        while True:
            self.write()
            await asyncio.sleep(PROGRESS_EVERY_S)

    def write(self) -> None:
        partial = self.path.with_suffix(".part")
        partial.write_text(json.dumps({"flowing": self.flowing, "ended": self.ended}))
        partial.rename(self.path)


async def attempt(client, index: int, key: str, max_tokens: int, progress: Progress) -> dict:
    """One try of stream ``index`` with ``key``: what came back and how it ended."""
    import openai

    run: dict = {"sent_at": time.time(), "first_token_at": None, "tokens": 0, "job": None, "finish_reason": None}
    run |= {"usage": None, "status": None, "served_by": None, "request_id": None, "replayed": False, "code": None}
    flowing = False
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": load.prompt(index)}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"Idempotency-Key": key},
        )
        run |= served(raw.status_code, raw.headers)
        run["replayed"] = raw.headers.get("idempotent-replayed") == "true"
        async for chunk in raw.parse():
            run["job"] = run["job"] or chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                if not flowing:
                    flowing, run["first_token_at"] = True, time.time()
                    progress.flowing += 1
                run["tokens"] += 1
            if chunk.choices:
                run["finish_reason"] = chunk.choices[0].finish_reason or run["finish_reason"]
            if chunk.usage is not None:
                run["usage"] = chunk.usage.model_dump()
        complete = run["finish_reason"] is not None and run["usage"] is not None
        run |= {"outcome": "ok", "retryable": False} if complete else {"outcome": "cut", "retryable": True}
    except openai.APIStatusError as exc:
        status = exc.status_code
        run |= served(status, exc.response.headers)
        run |= {"outcome": f"http_{status}", "code": exc.code, "error": str(exc)[:300]}
        run["retryable"] = status >= 500 or status in RETRYABLE_STATUS
    except openai.APIError as exc:
        if isinstance(exc, openai.APIConnectionError):
            run |= {"outcome": "cut", "retryable": True, "error": repr(exc)[:300]}
        else:  # an error event in the stream: its job failed, and the key makes a retry safe
            run |= {"outcome": "error_event", "retryable": True, "code": exc.code, "error": str(exc)[:300]}
    except Exception as exc:  # the connection dropped mid-stream (a web host gone): retry with the key
        run |= {"outcome": "cut", "retryable": True, "error": repr(exc)[:300]}
    finally:
        if flowing:
            progress.flowing -= 1
        run["ended_at"] = time.time()
    return run


def served(status: int, headers) -> dict:
    return {"status": status, "served_by": headers.get("x-served-by"), "request_id": headers.get("x-request-id")}


async def stream(client, index: int, key: str, max_tokens: int, progress: Progress) -> dict:
    """Stream ``index`` to its end: retried with its key while the failure is one to retry."""
    attempts: list[dict] = []
    pause = RETRY_PAUSE_S
    while True:
        attempts.append(await attempt(client, index, key, max_tokens, progress))
        last = attempts[-1]
        if last["outcome"] == "ok" or not last["retryable"] or len(attempts) == MAX_ATTEMPTS:
            break
        await asyncio.sleep(pause)
        pause *= 2
    progress.ended += 1
    return {"index": index, "key": key, "attempts": attempts}


async def run_client(args: argparse.Namespace) -> dict:
    progress = Progress(args.progress)
    writer = asyncio.create_task(progress.keep_writing())
    async with load.client(args.url, args.api_key) as client:
        warmup = [
            await stream(client, 10_000 + i, f"{args.run}-warmup-{i}", args.max_tokens, progress)
            for i in range(args.warmup)
        ]
        progress.ended = 0
        started = time.time()
        streams = await asyncio.gather(
            *(stream(client, i, f"{args.run}-{i}", args.max_tokens, progress) for i in range(args.streams))
        )
    writer.cancel()
    progress.write()
    return {"warmup": warmup, "streams": list(streams), "started_at": started, "ended_at": time.time()}


def client(args: argparse.Namespace) -> int:
    result = asyncio.run(run_client(args))
    args.out.write_text(json.dumps(result))
    return 0


# --- report (ops) -----------------------------------------------------------------------------


def worth(job) -> int:
    """What the job's delivered tokens cost at its prices, within its hold (settlement's rule)."""
    from marketplace.billing.services import cost

    prices = (job.price_prompt_per_million, job.price_completion_per_million)
    return min(cost(job.prompt_tokens, job.completion_tokens, prices) if job.completion_tokens else 0, job.hold_amount)


def ledger(customer_pk: int, granted_nano: int, keys: dict[str, list[str]]) -> dict:
    """The ledger checked exactly, Idempotency-Keys included:

    - each job settled, charged at most once and refunded at most once, and costing its customer
      (charges less refunds) its delivered tokens' price when it succeeded verified or was
      cancelled, else nothing; a superseded job (a retry of its key ran afresh) nothing;
    - a job that costs anything is its key's last attempt (``IdempotentRequest.job``), and no key's
      jobs (``keys``: each key's request ids) cost more than one attempt's;
    - every hold released, and the customer's credits + holds + charges - refunds == the grant."""
    from django.contrib.auth import get_user_model
    from django.db.models import Sum

    from marketplace.billing.models import AccountKind, Transfer
    from marketplace.billing.services import account
    from marketplace.jobs.models import IdempotentRequest, Job, JobState

    jobs = list(Job.objects.filter(customer_id=customer_pk).order_by("pk"))
    moves: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for job_pk, kind, amount in Transfer.objects.filter(job__in=jobs).values_list("job_id", "kind", "amount"):
        moves[job_pk][kind].append(amount)
    last_attempts = set(IdempotentRequest.objects.filter(customer_id=customer_pk).values_list("job_id", flat=True))
    problems, costs, by_request = [], {}, defaultdict(list)
    for job in jobs:
        charges, refunds = moves[job.pk]["charge"], moves[job.pk]["refund"]
        costs[job.pk] = sum(charges) - sum(refunds)
        by_request[job.request_id].append(job)
        billable = (job.verified is True or job.state == JobState.CANCELLED) and job.superseded_at is None
        owed = worth(job) if billable else 0
        if job.settled_at is None or len(charges) > 1 or len(refunds) > 1 or costs[job.pk] != owed:
            problems.append(f"{job.public_id}: charged {charges}, refunded {refunds}, owed {owed}, {job.state}")
        if costs[job.pk] and (job.first_choice_id or job.pk) not in last_attempts:
            problems.append(f"{job.public_id} costs {costs[job.pk]} but is not its key's last attempt")
    twice = []
    for key, request_ids in keys.items():
        paying = [job for rid in set(request_ids) for job in by_request.get(rid, []) if costs[job.pk] > 0]
        if len(paying) > 1:
            twice.append(key)
            problems.append(f"key {key} pays for {[job.public_id for job in paying]}")
    customer = get_user_model().objects.get(pk=customer_pk)
    hold = account(AccountKind.CUSTOMER_HOLD, customer).balance
    credit = account(AccountKind.CUSTOMER_CREDIT, customer).balance
    totals = Transfer.objects.filter(job__in=jobs)
    charged = totals.filter(kind="charge").aggregate(total=Sum("amount"))["total"] or 0
    refunded = totals.filter(kind="refund").aggregate(total=Sum("amount"))["total"] or 0
    if hold != 0:
        problems.append(f"{hold} nano-dollars still held")
    if credit + hold + charged - refunded != granted_nano:
        problems.append(f"credit {credit} + held {hold} + charged {charged} - refunded {refunded} != {granted_nano}")
    return {
        "exact": not problems,
        "problems": problems[:20],
        "jobs": len(jobs),
        "charged_nano": charged,
        "refunded_nano": refunded,
        "superseded_jobs": sum(1 for job in jobs if job.superseded_at is not None),
        "keys_charged_twice": len(twice),
    }


def report(args: argparse.Namespace) -> int:
    django_setup()
    from marketplace.jobs.models import Job

    load.quiet(args.timeout)
    keys = json.loads(args.keys.read_text())
    answer = {"ledger": ledger(args.customer, args.granted, keys), "jobs": {}}
    for job in Job.objects.filter(customer_id=args.customer):
        answer["jobs"][job.public_id] = {
            "request_id": job.request_id,
            "coordinator": job.coordinator_process.split(":", 1)[0],  # its host's name
            "state": job.state,
            "error_code": job.error_code,
            "completion_tokens": job.completion_tokens,
            "charged_nano": job.charged_amount,
            "superseded": job.superseded_at is not None,
        }
    print(json.dumps(answer))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("setup").add_argument("--out", type=Path, required=True)
    commands.add_parser("ready").add_argument("--timeout", type=float, default=600.0)
    run = commands.add_parser("client")
    run.add_argument("--url", required=True)
    run.add_argument("--api-key", required=True)
    run.add_argument("--run", required=True, help="the run's name: its keys' prefix")
    run.add_argument("--streams", type=int, required=True)
    run.add_argument("--warmup", type=int, default=2)
    run.add_argument("--max-tokens", type=int, required=True)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--progress", type=Path, required=True)
    check = commands.add_parser("report")
    check.add_argument("--customer", type=int, required=True)
    check.add_argument("--granted", type=int, required=True)
    check.add_argument("--keys", type=Path, required=True, help="JSON: each key's request ids")
    check.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    return {"setup": setup, "ready": ready, "client": client, "report": report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
