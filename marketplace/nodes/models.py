"""The node registry: who provides which machine, its key, hardware, state and links."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class NodeState(models.TextChoices):
    PENDING = "pending", "pending"  # added by its owner, agent not joined yet
    ACTIVE = "active", "active"  # joined and heartbeating
    DRAINING = "draining", "draining"  # finishing work, gets no new assignment
    OFFLINE = "offline", "offline"  # missed heartbeats past the timeout
    EJECTED = "ejected", "ejected"  # removed by strikes or an admin; cannot come back by itself
    DELETED = "deleted", "deleted"  # deleted by its owner; the row stays so its jobs settle and pay it


class Reachability(models.TextChoices):
    """How the control plane last reached a node's data plane (marketplace/nodes/reachability.py)."""

    UNCHECKED = "unchecked", "not checked yet"
    DIRECT = "direct", "reached directly"
    RELAYED = "relayed", "reached through a relay"
    UNREACHABLE = "unreachable", "unreachable"


class Privacy(models.TextChoices):
    """Which nodes may see a request (docs/privacy.md, "Who sees what"). Stage 0 sees the prompt's embeddings
    and the last stage the states the output's logits come from; every stage sees activations."""

    ANY = "any", "Any node"
    TRUSTED_ENDS = "trusted_ends", "Trusted first and last stages"
    TRUSTED_ONLY = "trusted_only", "Trusted nodes only"


PRIVACY_ORDER = (Privacy.ANY, Privacy.TRUSTED_ENDS, Privacy.TRUSTED_ONLY)  # weakest first


def strictest(*modes: str) -> str:
    """The strictest of ``modes`` (``Privacy`` values): a key's floor and a request's ask combine so."""
    return str(max(modes, key=PRIVACY_ORDER.index, default=Privacy.ANY))  # str(): the value, "any"


class Node(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="nodes")
    name = models.CharField(max_length=100)
    region = models.CharField(max_length=64, default="local")
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.PENDING)

    # Set when the agent joins: node id = "node-" + sha256(public key)[:16], as the agent computes it.
    node_id = models.CharField(max_length=32, unique=True, null=True, blank=True)
    public_key = models.CharField(max_length=64, unique=True, null=True, blank=True)  # ed25519, hex

    # One-time join token: only its sha256 is stored; the token itself is shown once.
    join_token_hash = models.CharField(max_length=64, unique=True, null=True, blank=True)
    join_token_expires_at = models.DateTimeField(null=True, blank=True)
    # The sha256 of the token its agent last joined with: a check of that token can say "used"
    # rather than "unknown", and a join retried after its answer was lost is recognised.
    used_join_token_hash = models.CharField(max_length=64, null=True, blank=True, db_index=True)

    # Hardware and benchmark, as the agent reported them at join.
    device = models.CharField(max_length=16, blank=True)  # "cpu" or "cuda"
    device_name = models.CharField(max_length=128, blank=True)
    memory_bytes = models.BigIntegerField(default=0)  # memory available for weights and KV caches
    # What memory challenges measured of it (``verification.claims``), in the same unit: the most memory
    # a passed one proved (what its blocks and the positions it held need), and the least it could
    # have, at most, after it failed to hold the positions one asked; placement believes no more.
    verified_memory_bytes = models.BigIntegerField(null=True, blank=True)
    memory_limit_bytes = models.BigIntegerField(null=True, blank=True)
    dtypes = models.JSONField(default=list)
    max_layers = models.PositiveIntegerField(null=True, blank=True)  # a cap the owner set; else from memory
    # The cap its owner gave when adding it (dashboard or API): the agent's own --max-layers can only
    # lower it, so the one-line command needs no option for it.
    layer_cap = models.PositiveIntegerField(null=True, blank=True)
    # Positions one session may hold on it (prompt + completion tokens); None: the agent did not say.
    max_positions = models.PositiveIntegerField(null=True, blank=True)
    max_sessions = models.PositiveIntegerField(null=True, blank=True)  # sessions at once per stage, as reported
    compute_layer_tokens_per_s = models.FloatField(default=0.0)  # decode, batch 1, from `swarm-worker bench`
    # The best speed the control plane itself measured (a passed challenge, timed): see nodes/capacity.py.
    verified_layer_tokens_per_s = models.FloatField(null=True, blank=True)
    uplink_mbps = models.FloatField(null=True, blank=True)
    data_url = models.CharField(max_length=255, blank=True)  # ws://host:port of its data plane
    # What the control plane found when it opened the data URL the agent reported, and why: the
    # node page says it, so an owner behind a NAT router learns why its node serves through a relay.
    reachability = models.CharField(max_length=16, choices=Reachability.choices, default=Reachability.UNCHECKED)
    reachability_detail = models.TextField(blank=True)
    relay = models.CharField(max_length=64, blank=True)  # the relay it serves through (SWARM_RELAYS id)
    reachability_checked_at = models.DateTimeField(null=True, blank=True)
    # The certificate the swarm's CA issued its agent at its last join (PEM, marketplace/nodes/authority.py):
    # it serves wss:// with it. Empty: the node joined without TLS (a plain ws:// data plane).
    tls_certificate = models.TextField(blank=True)
    agent_version = models.CharField(max_length=32, blank=True)

    reputation = models.FloatField(default=1.0)  # 0..1, see marketplace.verification.reputation
    reputation_detail = models.JSONField(default=dict)  # its components and their explanation
    # How often it is spot-checked (marketplace.verification.rates), refreshed with its reputation;
    # None until first computed (a new node's defaults apply).
    audit_fraction = models.FloatField(null=True, blank=True)
    challenges_per_day = models.FloatField(null=True, blank=True)
    online_s = models.FloatField(default=0.0)  # seconds heartbeating since it joined (uptime's numerator)
    ejected_at = models.DateTimeField(null=True, blank=True)
    ejection_reason = models.TextField(blank=True)
    # Set when its owner deleted it (state DELETED): hidden from the owner's lists, never placed or
    # routed, but kept, because jobs it served settle afterwards and pay its owner.
    deleted_at = models.DateTimeField(null=True, blank=True)
    connected = models.BooleanField(default=False)
    connected_since = models.DateTimeField(null=True, blank=True)  # when the current control channel opened
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    load = models.JSONField(default=dict)  # the last heartbeat's load report
    # When a job's coordinator last reported this node failed (a dead or stalled stage): no request
    # is routed to it until a heartbeat sent after the report clears it, or the sweep takes it offline.
    suspected_at = models.DateTimeField(null=True, blank=True)
    suspicion = models.CharField(max_length=255, blank=True)  # the reported failure
    # Failures a job's coordinator attributed to it (a stall, a dropped connection, a receipt it owed
    # and never sent: marketplace.verification.failures), counted in windows of SWARM_FAILURE_WINDOW_S
    # from the first; no request is routed to it before ``routing_backoff_until``, which doubles with
    # each failure of the window. Unlike a suspicion, no heartbeat and no reconnect clears these.
    recent_failures = models.PositiveIntegerField(default=0)  # in the current window
    # ... of which the node's agent stayed up and heartbeating through: no crash, restart or freeze
    # (churn) explains them; only these lead to a strike.
    recent_deliberate = models.PositiveIntegerField(default=0)
    last_failure_at = models.DateTimeField(null=True, blank=True)  # the latest counted one (an incident)
    failures_since = models.DateTimeField(null=True, blank=True)  # the current window's first failure
    failures_total = models.PositiveIntegerField(default=0)  # every attributed failure since it was added
    routing_backoff_until = models.DateTimeField(null=True, blank=True)
    last_failure = models.CharField(max_length=255, blank=True)  # the latest one's reason
    # A strike is open on it (a failed audit or challenge, a lying receipt): no request is routed to
    # it until every open strike is decided (verification.strikes keeps this in step with them).
    under_review = models.BooleanField(default=False)
    joined_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Marked trusted by an admin (vetted hardware and operator): a customer may require that only
    # such nodes see its requests (Privacy). Set and cleared only through
    # marketplace.nodes.trust_marks, which records who, when and why.
    trusted_at = models.DateTimeField(null=True, blank=True)
    trusted_reason = models.TextField(blank=True)
    trusted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )

    class Meta:
        ordering = ["id"]
        constraints = [
            # A deleted node's name is free for a new node of the same owner.
            models.UniqueConstraint(
                fields=["owner", "name"], condition=models.Q(deleted_at__isnull=True), name="node_name_unique_per_owner"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.node_id or 'not joined'}, {self.state})"

    @property
    def trusted(self) -> bool:
        return self.trusted_at is not None


class LinkMeasurement(models.Model):
    """A measured link from a node to a peer node or a coordinator region (one direction)."""

    source = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="links")
    target = models.CharField(max_length=64)  # a node id, or "region:<name>"
    rtt_ms = models.FloatField()  # the latest report: what routing prices the hop at
    # The least this source ever reported for the link, over ``samples`` reports: load on either
    # end only adds delay, so this is what counts as its measurement against the other end's claim.
    lowest_rtt_ms = models.FloatField(null=True, blank=True)
    samples = models.PositiveIntegerField(default=0)
    uplink_mbps = models.FloatField(null=True, blank=True)
    measured_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["source", "target"], name="one_link_per_target")]
