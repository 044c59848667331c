"""The model catalog for staff (DRF): list, read, register, and change (enable or disable, the
reputation its nodes need, its prices) an entry, by name.

    POST  /api/v1/catalog/          {"name", "source_kind", "source", "source_sha256"?, "min_reputation"?,
                                     "enabled"?, "prompt_price"?, "completion_price"?}
    PATCH /api/v1/catalog/<name>/   {"enabled"?, "min_reputation"?, "prompt_price"?, "completion_price"?}

A registration reads, copies and hashes the checkpoint before it answers (``flows.offerings.register``):
seconds for a small one, minutes for tens of GB. A refusal answers 400 with the catalog's error
code (``catalog.errors``) and the field it is about.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, permissions, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from marketplace.api import serializers as s
from marketplace.api.errors import error_response
from marketplace.catalog.errors import CatalogError
from marketplace.catalog.models import CatalogModel
from marketplace.flows import offerings


class CatalogViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = s.CatalogModelSerializer
    permission_classes = [permissions.IsAdminUser]
    queryset = CatalogModel.objects.order_by("pk")
    lookup_field = "name"
    lookup_value_regex = r"[a-z0-9][a-z0-9._-]{0,63}"
    pagination_class = None  # an admin's catalog: tens of entries, not thousands

    @extend_schema(request=s.CatalogRegisterSerializer, responses={201: s.CatalogModelSerializer})
    def create(self, request: Request) -> Response:
        data = s.CatalogRegisterSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            entry = offerings.register(**data.validated_data)
        except CatalogError as exc:
            return error_response(exc)
        return Response(s.CatalogModelSerializer(entry).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.CatalogChangeSerializer, responses=s.CatalogModelSerializer)
    def partial_update(self, request: Request, name: str | None = None) -> Response:
        entry = self.get_object()
        data = s.CatalogChangeSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            entry = offerings.update(entry.name, **data.validated_data)
        except CatalogError as exc:
            return error_response(exc)
        return Response(s.CatalogModelSerializer(entry).data)
