from __future__ import annotations

from rest_framework import serializers

from marketplace.catalog.models import DESCRIBED_BY, CatalogModel, SourceKind
from marketplace.flows import offerings
from marketplace.nodes.models import Node, Privacy


class NodeSerializer(serializers.ModelSerializer):
    layer_span = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "region",
            "state",
            "node_id",
            "public_key",
            "device",
            "device_name",
            "memory_bytes",
            "dtypes",
            "max_layers",
            "compute_layer_tokens_per_s",
            "uplink_mbps",
            "data_url",
            "reputation",
            "connected",
            "last_heartbeat_at",
            "load",
            "joined_at",
            "created_at",
            "layer_span",
        ]
        read_only_fields = fields

    def get_layer_span(self, node: Node) -> list[dict]:
        return [
            {
                "model": a.model,
                "layer_start": a.layer_start,
                "layer_end": a.layer_end,
                "state": a.state,
                "spare": a.is_spare,
            }
            for a in node.assignments.filter(state__in=["assigned", "ready"])
        ]


class NodeCreateSerializer(serializers.Serializer):
    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}$", max_length=100)
    region = serializers.RegexField(r"^[a-z0-9-]{1,64}$", required=False, default="local")
    max_layers = serializers.IntegerField(
        min_value=1,
        max_value=100_000,
        required=False,
        default=None,
        allow_null=True,
        help_text="the most layers the node may hold at once (default: as many as its memory allows); its "
        "agent's --max-layers can only lower it",
    )


JOIN_COMMAND_HELP = (
    "the one line to run on the machine, as the dashboard shows it: fetches the control plane's install "
    "script, which installs the agent and joins with the token (given in its environment, never as an argument)"
)


class NodeCreatedSerializer(NodeSerializer):
    join_token = serializers.CharField(read_only=True)
    join_command = serializers.CharField(read_only=True, help_text=JOIN_COMMAND_HELP)

    class Meta(NodeSerializer.Meta):
        fields = [*NodeSerializer.Meta.fields, "join_token", "join_command"]
        read_only_fields = fields


class JoinTokenSerializer(serializers.Serializer):
    join_token = serializers.CharField(read_only=True)
    join_command = serializers.CharField(read_only=True, help_text=JOIN_COMMAND_HELP)


class AgentRegisterSerializer(serializers.Serializer):
    token = serializers.CharField(max_length=128)
    public_key = serializers.RegexField(r"^[0-9a-fA-F]{64}$")
    signature = serializers.RegexField(r"^[0-9a-fA-F]{128}$")
    hardware = serializers.DictField()
    benchmark = serializers.DictField()
    data_url = serializers.CharField(max_length=255)
    agent_version = serializers.CharField(max_length=32, required=False, default="")
    # Its size and contents are checked by the swarm's CA (marketplace/nodes/authority.py), which
    # says what is wrong more precisely than a field limit would.
    csr = serializers.CharField(
        required=False, trim_whitespace=False, help_text="a PEM certificate signing request for its TLS key"
    )


class AgentTokenCheckSerializer(serializers.Serializer):
    token = serializers.CharField(max_length=128)


class AgentTokenCheckedSerializer(serializers.Serializer):
    valid = serializers.BooleanField()
    node_name = serializers.CharField(help_text="the name its owner gave the node the token joins")
    expires_at = serializers.DateTimeField(help_text="when the token stops working, if unused")


class AgentRegisteredSerializer(serializers.Serializer):
    node = serializers.CharField()
    control_url = serializers.CharField()
    heartbeat_interval_s = serializers.FloatField()
    ticket_key = serializers.CharField(help_text="the control plane's ticket-signing ed25519 public key (hex)")
    ca_certificate = serializers.CharField(
        required=False, help_text="the swarm CA's certificate (PEM), when a CSR was sent: the agent pins it"
    )
    node_certificate = serializers.CharField(
        required=False, help_text="the node's certificate from that CA (PEM), for the CSR's key"
    )


class ApiKeySerializer(serializers.Serializer):
    id = serializers.IntegerField(read_only=True)
    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}$", max_length=100)
    prefix = serializers.CharField(read_only=True)
    requests_per_minute = serializers.IntegerField(read_only=True)
    tokens_per_minute = serializers.IntegerField(read_only=True)
    privacy = serializers.ChoiceField(
        choices=Privacy.choices,
        default=Privacy.ANY,
        help_text="which nodes every request of the key may pass through: any node, trusted first and last "
        "stages (trusted_ends), or trusted nodes only (trusted_only); a request's provider object may ask for more",
    )
    created_at = serializers.DateTimeField(read_only=True)
    last_used_at = serializers.DateTimeField(read_only=True)
    revoked_at = serializers.DateTimeField(read_only=True)


class ApiKeyPrivacySerializer(serializers.Serializer):
    privacy = serializers.ChoiceField(choices=Privacy.choices)


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="the full key: shown once, never again")


class CatalogModelSerializer(serializers.ModelSerializer):
    """A catalog entry as staff read it: what was registered, what was read from the checkpoint, and
    its prices in force (dollars per million tokens, as decimal strings)."""

    ref = serializers.CharField(read_only=True)
    prompt_price = serializers.SerializerMethodField()
    completion_price = serializers.SerializerMethodField()

    class Meta:
        model = CatalogModel
        fields = [
            *DESCRIBED_BY,
            "min_reputation",
            "enabled",
            "prompt_price",
            "completion_price",
            "files",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields

    def get_prompt_price(self, entry: CatalogModel) -> str:
        return format(offerings.prices(entry.name)[0].normalize(), "f")

    def get_completion_price(self, entry: CatalogModel) -> str:
        return format(offerings.prices(entry.name)[1].normalize(), "f")


class CatalogChangeSerializer(serializers.Serializer):
    """What staff may change of an entry. Values are checked by the service, whose refusal names
    the field: prices are dollars per million tokens (a string or a number, >= 0, 9 decimals)."""

    enabled = serializers.BooleanField(required=False)
    min_reputation = serializers.FloatField(required=False)
    prompt_price = serializers.CharField(required=False, max_length=40)
    completion_price = serializers.CharField(required=False, max_length=40)


class CatalogRegisterSerializer(CatalogChangeSerializer):
    """A registration: a name and a source; everything else is read from the checkpoint."""

    name = serializers.CharField(max_length=200)
    source_kind = serializers.ChoiceField(choices=SourceKind.choices)
    source = serializers.CharField(max_length=1024)
    source_sha256 = serializers.CharField(required=False, allow_blank=True, max_length=200)
