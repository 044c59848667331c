"""Customer-facing billing: balance, transactions, usage (JSON and CSV), and the
OpenRouter-style key endpoints `GET /api/v1/credits` and `GET /api/v1/generation?id=`."""

from __future__ import annotations

import csv
import io

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import permissions
from rest_framework.decorators import api_view, permission_classes
from rest_framework.request import Request
from rest_framework.response import Response

from marketplace.api.auth import api_key_required
from marketplace.api.errors import renders_domain_errors
from marketplace.api.views import IsCustomer
from marketplace.billing import selectors
from marketplace.db import releases_db
from marketplace.jobs import selectors as job_selectors
from marketplace.jobs.errors import InvalidRequest, JobNotFound
from marketplace.jobs.models import ApiKey, Job

GROUPS = ("day", "model", "key")


@extend_schema(responses=OpenApiTypes.OBJECT)
@api_view(["GET"])
@permission_classes([permissions.IsAuthenticated, IsCustomer])
def balance(request: Request) -> Response:
    values = {**selectors.balance(request.user), **selectors.totals(request.user)}
    return Response({name: format(value, "f") for name, value in values.items()})


@extend_schema(responses=OpenApiTypes.OBJECT)
@api_view(["GET"])
@permission_classes([permissions.IsAuthenticated, IsCustomer])
def transactions(request: Request) -> Response:
    return Response({"data": selectors.transactions(request.user)})


def _group(request) -> str:
    group = request.GET.get("group", "day")
    if group not in GROUPS:
        raise InvalidRequest(f"group must be one of {', '.join(GROUPS)}", param="group")
    return group


@extend_schema(responses=OpenApiTypes.OBJECT)
@api_view(["GET"])
@permission_classes([permissions.IsAuthenticated, IsCustomer])
@renders_domain_errors
def usage(request: Request) -> Response:
    group = _group(request)
    return Response({"group": group, "data": job_selectors.usage(request.user, group)})


@extend_schema(responses={(200, "text/csv"): OpenApiTypes.STR})
@api_view(["GET"])
@permission_classes([permissions.IsAuthenticated, IsCustomer])
@renders_domain_errors
def usage_csv(request: Request) -> HttpResponse:
    group = _group(request)
    rows = job_selectors.usage(request.user, group)
    out = io.StringIO()
    writer = csv.writer(out)
    named = ["key_name"] if group == "key" else []
    writer.writerow([group, *named, "requests", "prompt_tokens", "completion_tokens", "cost_usd"])
    for row in rows:
        values = [row["requests"], row["prompt_tokens"], row["completion_tokens"], row["cost"]]
        writer.writerow([row[group], *(row[name] for name in named), *values])
    response = HttpResponse(out.getvalue(), content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="usage-by-{group}.csv"'
    return response


@releases_db
@api_key_required
async def credits(request: HttpRequest, api_key: ApiKey) -> JsonResponse:
    """`{"data": {"total_credits", "total_usage"}}` in dollars for the calling key's account."""
    totals = await sync_to_async(selectors.totals)(api_key.user)
    return JsonResponse({"data": {k: float(v) for k, v in totals.items()}})


@releases_db
@api_key_required
@renders_domain_errors
async def generation(request: HttpRequest, api_key: ApiKey) -> JsonResponse:
    """One request's model, token counts, cost and state, by its completion id."""
    public_id = request.GET.get("id", "")
    if not public_id:
        raise InvalidRequest("give the completion id as ?id=", param="id")
    job = await sync_to_async(Job.objects.filter(customer=api_key.user, public_id=public_id).first)()
    if job is None:
        raise JobNotFound(f"no generation {public_id!r}", param="id")
    return JsonResponse(
        {
            "data": {
                "id": job.public_id,
                "request_id": job.request_id or None,  # the x-request-id of the request that made it
                "model": job.model,
                "state": job.state,
                "finish_reason": job.finish_reason or None,
                "tokens_prompt": job.prompt_tokens,
                "tokens_completion": job.completion_tokens,
                "total_cost": float(selectors.dollars(job.charged_amount)),
                "created_at": job.created_at.isoformat(),
                "latency_ms": job.ttft_ms,
                "tokens_per_second": job.tokens_per_s,
                "verified": job.verified,
            }
        }
    )
