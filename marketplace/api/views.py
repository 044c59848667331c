"""The provider API for nodes and the agents' join endpoint (DRF)."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django.http import JsonResponse
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, permissions, status, viewsets
from rest_framework.decorators import action, api_view, authentication_classes, permission_classes
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from marketplace.api import serializers as s
from marketplace.api.errors import error_body, error_response, http_error
from marketplace.install.script import join_command
from marketplace.jobs import services as jobs_services
from marketplace.jobs.errors import ApiKeyLimitReached, ApiKeyNameTaken
from marketplace.jobs.models import ApiKey
from marketplace.nodes import joining
from marketplace.nodes.authority import ca_certificate
from marketplace.nodes.errors import InvalidJoinToken, NodeError, NodeNameTaken, TooManyTokenChecks
from marketplace.nodes.models import Node
from marketplace.nodes.tickets import issuer_public_key
from marketplace.placement import lifecycle


class IsProvider(permissions.BasePermission):
    message = "this endpoint is for providers"

    def has_permission(self, request, view) -> bool:
        return bool(request.user and request.user.is_authenticated and request.user.is_provider)


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """A provider's own nodes. Another provider's node, or a deleted one, answers 404, as if it did not exist."""

    serializer_class = s.NodeSerializer
    permission_classes = [permissions.IsAuthenticated, IsProvider]

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation has no user
            return Node.objects.none()
        return (
            Node.objects.filter(owner=self.request.user, deleted_at__isnull=True)
            .prefetch_related("assignments")
            .order_by("id")
        )

    @extend_schema(request=s.NodeCreateSerializer, responses={201: s.NodeCreatedSerializer})
    def create(self, request: Request) -> Response | JsonResponse:
        data = s.NodeCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            node, token = joining.create_node(owner=request.user, **data.validated_data)
        except NodeNameTaken as exc:  # a field's refusal, in DRF's shape like the serializer's own
            raise ValidationError({exc.param: [str(exc)]}) from exc
        except NodeError as exc:
            return error_response(exc)
        body = s.NodeSerializer(node).data | {"join_token": token, "join_command": join_command(request, token)}
        return Response(body, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: Node) -> None:
        lifecycle.delete_node(instance)

    @extend_schema(request=None, responses=s.NodeSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk=None) -> Response:
        node = lifecycle.drain_node(self.get_object())
        return Response(s.NodeSerializer(node).data)

    @extend_schema(request=None, responses=s.JoinTokenSerializer)
    @action(detail=True, methods=["post"], url_path="rotate-token")
    def rotate_token(self, request: Request, pk=None) -> Response:
        token = joining.rotate_join_token(self.get_object())
        return Response({"join_token": token, "join_command": join_command(request, token)})


@extend_schema(request=s.AgentRegisterSerializer, responses={201: s.AgentRegisteredSerializer})
@api_view(["POST"])
@authentication_classes([])
@permission_classes([permissions.AllowAny])
def register_agent(request: Request) -> Response | JsonResponse:
    """An agent joins with its one-time token, proving it holds the key it registers."""
    data = s.AgentRegisterSerializer(data=request.data)
    data.is_valid(raise_exception=True)
    try:
        with transaction.atomic():
            node = lifecycle.register_agent(**data.validated_data)
    except NodeError as exc:
        return error_response(exc)
    scheme = "wss" if request.is_secure() else "ws"
    control_url = f"{scheme}://{request.get_host()}/ws/agent/"
    # The agent pins the ticket-signing key from this answer (over the join's own HTTPS in
    # production), and later refuses a control channel that names another; likewise the swarm's
    # CA, the only anchor its data plane's TLS trusts, when it sent a CSR.
    answer = {
        "node": node.node_id,
        "control_url": control_url,
        "heartbeat_interval_s": settings.SWARM_HEARTBEAT_INTERVAL_S,
        "ticket_key": issuer_public_key().hex(),
    }
    if node.tls_certificate:
        answer |= {"ca_certificate": ca_certificate(), "node_certificate": node.tls_certificate}
    return Response(answer, status=status.HTTP_201_CREATED)


class IsCustomer(permissions.BasePermission):
    message = "this endpoint is for customers"

    def has_permission(self, request, view) -> bool:
        return bool(request.user and request.user.is_authenticated and request.user.is_customer)


class ApiKeyViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet
):
    """A customer's API keys: listed by prefix; the full key is shown once, at creation.
    DELETE revokes a key (it stays listed, with revoked_at)."""

    serializer_class = s.ApiKeySerializer
    permission_classes = [permissions.IsAuthenticated, IsCustomer]

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return ApiKey.objects.none()
        return ApiKey.objects.filter(user=self.request.user)

    @extend_schema(request=s.ApiKeySerializer, responses={201: s.ApiKeyCreatedSerializer})
    def create(self, request: Request) -> Response | JsonResponse:
        data = s.ApiKeySerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            api_key, key = jobs_services.create_api_key(
                request.user, data.validated_data["name"], data.validated_data["privacy"]
            )
        except (ApiKeyNameTaken, ApiKeyLimitReached) as exc:
            return error_response(exc)
        return Response(s.ApiKeySerializer(api_key).data | {"key": key}, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.ApiKeyPrivacySerializer, responses={200: s.ApiKeySerializer})
    def partial_update(self, request: Request, pk=None) -> Response:
        """PATCH {"privacy": ...}: which nodes the key's requests may pass through, from the next request on."""
        data = s.ApiKeyPrivacySerializer(data=request.data)
        data.is_valid(raise_exception=True)
        api_key = jobs_services.set_key_privacy(self.get_object(), data.validated_data["privacy"])
        return Response(s.ApiKeySerializer(api_key).data)

    def perform_destroy(self, instance: ApiKey) -> None:
        jobs_services.revoke_api_key(instance)


@extend_schema(request=s.AgentTokenCheckSerializer, responses={200: s.AgentTokenCheckedSerializer})
@api_view(["POST"])
@authentication_classes([])
@permission_classes([permissions.AllowAny])
def check_join_token(request: Request) -> Response | JsonResponse:
    """Whether a join token would join its node now, without using it up: an agent asks before its
    benchmark, so a wrong token fails at once. A refusal names its ``reason`` (unknown, used,
    expired) next to the code ``invalid_join_token``."""
    data = s.AgentTokenCheckSerializer(data=request.data)
    data.is_valid(raise_exception=True)
    try:
        node = joining.check_join_token(data.validated_data["token"], address=request.META.get("REMOTE_ADDR", ""))
    except NodeError as exc:
        body = error_body(exc)
        if isinstance(exc, InvalidJoinToken):
            body["error"]["reason"] = exc.reason
        response = JsonResponse(body, status=http_error(exc).status)
        if isinstance(exc, TooManyTokenChecks):
            response["Retry-After"] = str(exc.retry_after)
        return response
    return Response({"valid": True, "node_name": node.name, "expires_at": node.join_token_expires_at})
