"""Admitting a request: its jobs, each on a ready route with room for it, audited positions drawn,
and the worst case of its price held on the customer's credit, all in one transaction or none.

Admission reads placement's routes and the jobs in flight on them, draws the stages to audit
(``verification.audits``) and places the hold (``settlement.place_hold``): 503 when no route is
ready or every one is full, 402 when the credits do not cover the hold, and nothing was written.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from django.db import transaction

from marketplace.flows.settlement import hold_terms, place_hold
from marketplace.jobs.errors import NoCapacity, NoTrustedCapacity, Overloaded
from marketplace.jobs.models import ApiKey, Job
from marketplace.jobs.params import RequestParams
from marketplace.jobs.prefixes import remembered_route
from marketplace.jobs.route import route_of
from marketplace.jobs.selectors import jobs_in_flight
from marketplace.nodes.models import Privacy, strictest
from marketplace.placement.selectors import hold_routes, route_request
from marketplace.verification.audits import choose_audit_stages


@transaction.atomic
def admit_jobs(
    *, api_key: ApiKey, kind: str, model: str, params: RequestParams, prompt_ids: Sequence[int], request_id: str = ""
) -> list[Job]:
    """Admit a request's ``params.n`` choices together, each a job of its own (``admit_job``)
    with its own route, hold and receipts: all of them, or none (402 or 503 for one rolls every
    one back). Choice 0 carries the response's id; choice i's id adds ``-i`` to it. Each records
    ``request_id``, the HTTP request's."""
    jobs = [
        admit_job(api_key=api_key, kind=kind, model=model, params=params, prompt_ids=prompt_ids, request_id=request_id)
    ]
    for index in range(1, params.n):
        jobs.append(
            admit_job(
                api_key=api_key,
                kind=kind,
                model=model,
                params=params.for_choice(index),
                prompt_ids=prompt_ids,
                first_choice=jobs[0],
                choice_index=index,
                request_id=request_id,
            )
        )
    return jobs


OVERLOADED_RETRY_AFTER_S = 2  # Retry-After of a 503 overloaded
NO_TRUSTED: dict[str, str] = {  # by privacy (a Privacy is its value: a request's privacy looks it up)
    Privacy.TRUSTED_ONLY: (
        "No route of trusted nodes is ready for model {model!r}; the request asked for trusted nodes only "
        "(trusted_only) and was not sent to any other. Retry later, or drop the requirement."
    ),
    Privacy.TRUSTED_ENDS: (
        "No route with trusted first and last stages is ready for model {model!r}; the request asked for "
        "trusted ends (trusted_ends) and was not sent to any other. Retry later, or drop the requirement."
    ),
}


@transaction.atomic(savepoint=False)  # admit_jobs' transaction is all or none already
def admit_job(
    *,
    api_key: ApiKey,
    kind: str,
    model: str,
    params: RequestParams,
    prompt_ids: Sequence[int],
    first_choice: Job | None = None,
    choice_index: int = 0,
    request_id: str = "",
) -> Job:
    """Create a queued job on the lowest-latency ready route (or, within a margin of it, the one
    holding the prompt's longest prefix: ``jobs.prefixes``); 503 when the model has none.

    ``prompt_ids`` (from ``tokenize_prompt``) are stored with the job, so that its coordinator
    runs exactly the tokens the hold and the rate limit counted; ``request_id`` (the HTTP
    request's ``x-request-id``), so that an operator finds the job a customer quotes it for."""
    # One admission at a time per model from here to the commit: each counts the jobs in flight
    # that those before it admitted, so no stage is sent more sessions than it holds.
    privacy = strictest(api_key.privacy, params.privacy)
    placed = hold_routes(model)
    # KV locality: the route that served this account's longest prefix of the prompt, if any.
    prefer = remembered_route(api_key.user_id, model, prompt_ids)
    chosen = route_request(model, jobs_in_flight(), placed=placed, privacy=privacy, prefer=prefer)
    if chosen is None:
        if route_request(model, placed=placed, privacy=privacy) is not None:
            raise Overloaded(
                f"Model {model!r} is serving as many requests as its nodes hold; retry shortly.",
                retry_after=OVERLOADED_RETRY_AFTER_S,
            )
        if privacy != Privacy.ANY and route_request(model, placed=placed) is not None:
            raise NoTrustedCapacity(NO_TRUSTED[privacy].format(model=model))
        raise NoCapacity(f"No capacity for model {model!r} right now: no complete pipeline is ready.")
    region, stages, _ = chosen
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    route = route_of(stages)
    public_id = f"{prefix}-{uuid.uuid4().hex}" if first_choice is None else f"{first_choice.public_id}-{choice_index}"
    job = Job.objects.create(
        public_id=public_id,
        request_id=request_id,
        first_choice=first_choice,
        choice_index=choice_index,
        kind=kind,
        customer=api_key.user,
        api_key=api_key,
        model=model,
        params=params.to_json(),
        prompt_ids=list(prompt_ids),
        prompt_tokens=len(prompt_ids),
        coordinator_region=region,
        privacy=privacy,
        route=route,
        audit_stages=choose_audit_stages(route, fractions={stage.node: stage.audit_fraction for stage in stages}),
        **hold_terms(model, len(prompt_ids), params.max_tokens),
    )
    place_hold(job, priced=True)  # 402 here rolls the whole admission back
    return job
