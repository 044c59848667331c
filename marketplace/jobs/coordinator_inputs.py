"""The one adapter from the control plane's job types to the coordinator's inputs.

A job's row (``Job``), its request (``RequestParams``) and its route (``Job.route``'s JSON stages)
become, here and nowhere else:

- ``stage_specs``: each stage's ``StageSpec``, with a ticket for this job signed for the job's
  ``JobGrant`` (a coordinator key made for the job, and the tickets' deadline);
- ``coordinator_for``: the ``Coordinator`` of the job, with the control plane's own assignments for
  its route (``route.route_assignments``), the positions it audits, and the settings' heal, stall and
  speculation limits;
- ``healed_route``: the route a heal moved the job onto, as the coordinator goes on with it;
- ``generation_request``: the request the coordinator runs: the prompt's token ids, the sampling
  (``sampling_params``), stops, log-probabilities, speculation, the output's grammar (``json_grammar``)
  and the customer account's prefix salt (``prefixes.prefix_salt``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from ssl import SSLContext

from django.conf import settings
from nacl.signing import SigningKey

from marketplace.jobs import tools
from marketplace.jobs.models import Job
from marketplace.jobs.params import RequestParams
from marketplace.jobs.prefixes import prefix_salt
from marketplace.jobs.route import route_assignments
from marketplace.nodes.tickets import job_ticket_expiry, ticket_for
from worker_agent.coordinator import grammar
from worker_agent.coordinator.heal import HealedRoute, Healer
from worker_agent.coordinator.job import Coordinator, GenerationRequest
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.coordinator.sampling import SamplingParams
from worker_agent.coordinator.speculation import SpeculationSettings
from worker_agent.protocol.span import Span


@dataclass(frozen=True)
class JobGrant:
    """What a job's tickets name: its coordinator's key (fresh per job, never stored) and its deadline."""

    coordinator_key: SigningKey
    expires_at: float  # unix seconds: the job's timeout from its start, plus TICKET_MARGIN_S

    @classmethod
    def new(cls) -> JobGrant:
        return cls(SigningKey.generate(), job_ticket_expiry())


def stage_specs(job: Job, route: list[dict], grant: JobGrant) -> list[StageSpec]:
    """Each stage of ``route`` with a ticket for this job (an ed25519 signature each; the issuer
    key is read from its file once per process). Each stage's node too: over TLS the stage's
    certificate must name the node placed there."""
    return [
        StageSpec(
            stage["url"],
            ticket_for(
                job=job.public_id,
                node=stage["node"],
                span=Span(job.model, stage["layer_start"], stage["layer_end"]),
                coordinator_key=bytes(grant.coordinator_key.verify_key),
                expires_at=grant.expires_at,
            ),
            node=stage["node"],
        )
        for stage in route
    ]


def coordinator_for(
    job: Job, specs: list[StageSpec], grant: JobGrant, *, healer: Healer, tls: SSLContext | None
) -> Coordinator:
    """The job's coordinator over ``specs`` (its route's stages, ``stage_specs``), checking the
    stages' receipts against the control plane's assignments, never the stages' word."""
    return Coordinator(
        job.model,
        specs,
        job=job.public_id,
        topology=settings.SWARM_TOPOLOGY,
        assignments=route_assignments(job.route),
        audit_stages=tuple(job.audit_stages),
        healer=healer,
        max_heals=settings.SWARM_MAX_HEALS,
        stall_timeout_s=settings.SWARM_STALL_TIMEOUT_S,
        coordinator_key=grant.coordinator_key,
        speculation=speculation_settings(),
        tls=tls,
    )


def healed_route(specs: list[StageSpec], route: list[dict], audit_stages: Sequence[int]) -> HealedRoute:
    """The route a heal moved the job onto (``services.heal_job``), as its coordinator goes on with it:
    ``specs`` are the new route's stages (``stage_specs``), with the control plane's assignments."""
    return HealedRoute(tuple(specs), tuple(route_assignments(route)), tuple(audit_stages))


def generation_request(coordinator: Coordinator, job: Job, params: RequestParams) -> GenerationRequest:
    """The request ``coordinator`` runs for the job: the prompt's token ids stored at admission (the
    tokens its hold and rate limit counted) and the request's parameters."""
    return coordinator.request_ids(
        job.prompt_ids,
        max_tokens=params.max_tokens,
        sampling=sampling_params(params),
        stop=params.stop,
        speculate=params.speculation,
        logprobs=params.logprobs,
        grammar=json_grammar(params, coordinator.tokenizer),
        prefix_salt=prefix_salt(job.customer_id),
    )


def speculation_settings() -> SpeculationSettings:
    """The coordinators' speculation, from the settings (SWARM_SPECULATION, SWARM_DRAFT_MODEL)."""
    return SpeculationSettings(enabled=settings.SWARM_SPECULATION == "auto", draft_model=settings.SWARM_DRAFT_MODEL)


def sampling_params(params: RequestParams) -> SamplingParams:
    """The coordinator's sampling settings for a request's parameters."""
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=params.logit_bias,
    )


def json_grammar(params: RequestParams, tokenizer) -> grammar.Grammar | None:
    """The grammar the output must follow: calls of the chosen function(s) in the format the
    model's template teaches (or text, under ``"auto"``), or the request's ``response_format``
    (None: free text)."""
    if params.calls_tool:
        form = tools.call_format(tokenizer)
        return tools.call_grammar(
            params.tools, params.tool_choice, params.parallel_tool_calls, form, decide=params.tool_decides
        )
    if params.response_format is None:
        return None
    return grammar.JsonGrammar(params.response_format[1])
