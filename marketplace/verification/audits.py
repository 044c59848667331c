"""Live audits: ``choose_audit_stages`` picks, at admission, which stages of a job are audited (each
node at its own rate; every session is tapped, so nodes cannot tell); ``record_audits`` stores the
material the coordinator kept and ``verify_audit`` checks its hashes against the signed receipts
and replays it on the trusted block. A failure opens a strike.

Audits fail closed and blame the node that owed the evidence: an audited stage whose material did
not all arrive, or does not make valid material, is a failed audit of the stage whose bytes were
missing (its predecessor, for a tap of its inputs; itself, for its outputs). A recorded input that
is not what the predecessor signed as its output is the predecessor's forged tap: its strike, and
none for the audited node. A job's earnings stay pending while any of its audits is unchecked
(``strikes.withheld_earnings``)."""

from __future__ import annotations

import logging
import random

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace.billing.services import refund_charge
from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node
from marketplace.verification.dispatch import AUDIT_TASK, thresholds, verify_after_commit
from marketplace.verification.models import Audit, CheckState, StrikeKind
from marketplace.verification.receipts import session_receipt
from marketplace.verification.strikes import open_strike
from marketplace.verification.verifier import FALLBACK_DTYPE, reused_inputs, trusted_block
from worker_agent.coordinator.pipeline import AuditGap
from worker_agent.errors import SwarmError
from worker_agent.protocol.audit import AuditFailed, AuditMaterial
from worker_agent.protocol.audit import verify_audit as replay_audit
from worker_agent.protocol.receipts import MissingReceipt

log = logging.getLogger("swarm.verification")


def choose_audit_stages(
    route: list[dict], rng: random.Random | None = None, *, fractions: dict[str, float | None] | None = None
) -> list[int]:
    """The pipeline positions of a new job to audit: each stage's node at its own audit fraction
    (``fractions`` by node id when the caller read them already; None: a new node's default)."""
    rng = rng or random.SystemRandom()
    if fractions is None:
        fractions = {
            node_id: fraction
            for node_id, fraction in Node.objects.filter(node_id__in=[s["node"] for s in route]).values_list(
                "node_id", "audit_fraction"
            )
            if node_id is not None  # always: filtered by node id
        }
    chosen = []
    for index, stage in enumerate(route):
        fraction = fractions.get(stage["node"])
        if fraction is None:
            fraction = settings.SWARM_AUDIT_NEW_NODE_FRACTION
        if rng.random() < fraction:
            chosen.append(index)
    return chosen


@transaction.atomic
def record_audits(job, materials: list[AuditMaterial], gaps: list[AuditGap] | tuple = ()) -> list[int]:
    """Store the material a job's coordinator kept and queue its replay; each gap (an audited stage
    whose material could not be had) is a failed audit of the stage that owed the bytes."""
    nodes = {s["node"]: index for index, s in enumerate(job.route)}
    node_pks = dict(Node.objects.filter(node_id__in=list(nodes)).values_list("node_id", "pk"))
    created = []
    for gap in gaps:
        if not (0 <= gap.owed_by < len(job.route) and 0 <= gap.stage < len(job.route)):
            log.warning("job %s: an audit gap names stage %d of %d", job.public_id, gap.owed_by, len(job.route))
            continue
        owed = job.route[gap.owed_by]
        if owed["node"] not in node_pks:
            continue
        audit, new = Audit.objects.get_or_create(
            job=job,
            session=gap.session,
            stage=gap.stage,
            defaults={
                "node_id": node_pks[owed["node"]],
                "model": job.model,
                "layer_start": owed["layer_start"],
                "layer_end": owed["layer_end"],
                "material": b"",
            },
        )
        if new:
            created.append(audit.pk)
            reason = f"stage {gap.owed_by} (node {owed['node']}): {gap.reason}"
            _finish_audit(audit.pk, CheckState.FAILED, reason, {"code": "audit_missing"})
    for material in materials:
        if material.node not in node_pks or nodes[material.node] != material.stage:
            log.warning("job %s: audit material for %s does not match the route", job.public_id, material.node)
            continue
        audit, new = Audit.objects.get_or_create(
            job=job,
            session=material.session,
            stage=material.stage,
            defaults={
                "node_id": node_pks[material.node],
                "model": job.model,
                "layer_start": material.layer_start,
                "layer_end": material.layer_end,
                "material": material.to_bytes(),
            },
        )
        if new:
            created.append(audit.pk)
            verify_after_commit(AUDIT_TASK, verify_audit, audit.pk)
    return created


def verify_audit(audit_pk: int) -> Audit:
    """Check the material's hashes against the node's signed receipt, then replay it."""
    audit = Audit.objects.select_related("job", "node").get(pk=audit_pk)
    if audit.state != CheckState.PENDING:
        return audit
    upstream = None
    try:
        material = AuditMaterial.from_bytes(bytes(audit.material))
        receipt = session_receipt(audit.job, material.session, material.stage, material.node)
        if material.stage > 0:
            before = audit.job.route[material.stage - 1]
            upstream = session_receipt(audit.job, material.session, material.stage - 1, before["node"])
    except MissingReceipt:
        return _finish_audit(audit_pk, CheckState.ERROR, "the job holds no receipt of this node for the session", {})
    except SwarmError as exc:
        return _finish_audit(audit_pk, CheckState.ERROR, f"stored material or receipts unreadable: {exc}", {})
    try:
        block = trusted_block(audit.span)
        prefix = reused_inputs(material)
    except Exception as exc:
        log.exception("cannot load the trusted block for audit %s", audit_pk)
        return _finish_audit(audit_pk, CheckState.ERROR, f"verifier failed: {exc}", {})
    reference_dtype = "float32"
    try:
        try:
            report = replay_audit(material, receipt, block, upstream=upstream, prefix=prefix, **thresholds())
        except AuditFailed as exc:
            if exc.code != "audit_mismatch":
                raise
            fallback = trusted_block(audit.span, FALLBACK_DTYPE)
            try:
                report = replay_audit(material, receipt, fallback, upstream=upstream, prefix=prefix, **thresholds())
            except AuditFailed:
                raise exc from None  # the float32 replay's evidence is the one on record
            reference_dtype = FALLBACK_DTYPE
    except AuditFailed as exc:  # the node's fault: its bytes disagree with what it signed, or with the replay
        failed = exc.report
        metrics = _audit_metrics(failed) if failed is not None else {}
        if exc.upstream:  # the predecessor forged its tap: the failure and the strike are its own
            before = audit.job.route[audit.stage - 1]
            Audit.objects.filter(pk=audit_pk).update(
                node=Node.objects.get(node_id=before["node"]),
                layer_start=before["layer_start"],
                layer_end=before["layer_end"],
            )
        return _finish_audit(audit_pk, CheckState.FAILED, f"{exc} ({exc.code})", {**metrics, "code": exc.code})
    except SwarmError as exc:  # malformed material, a wrong trusted block: the verifier's problem, no strike
        log.error("audit %s could not be checked: %s", audit_pk, exc)
        return _finish_audit(audit_pk, CheckState.ERROR, f"{exc} ({exc.code})", {"code": exc.code})
    return _finish_audit(audit_pk, CheckState.PASSED, "", {**_audit_metrics(report), "reference": reference_dtype})


def _audit_metrics(report) -> dict:
    """A replay's report in the same shape as a challenge's comparison (worst values, thresholds)."""
    found = report.to_dict()
    return {
        "passed": found["passed"],
        "min_cosine": found["worst_cosine"],
        "max_rel_norm": found["worst_rel_norm"],
        "required_cosine": found["min_cosine"],
        "allowed_rel_norm": found["max_rel_norm"],
        "steps": found["steps"],
        "tokens": found["tokens"],
        "first_failure": found["first_failure"],
        "cosine": found["cosine"],
        "rel_norm": found["rel_norm"],
    }


def _finish_audit(audit_pk: int, state: str, reason: str, metrics: dict) -> Audit:
    with transaction.atomic():
        # The audit's row alone, without its material: the job (its receipts and transcripts) and
        # the node are read only for a failure's strike, and the material is neither read nor rewritten.
        audit = Audit.objects.select_for_update().defer("material").get(pk=audit_pk)
        if audit.state != CheckState.PENDING:
            return audit
        audit.state, audit.reason, audit.metrics, audit.checked_at = state, reason, metrics, timezone.now()
        audit.save(update_fields=["state", "reason", "metrics", "checked_at"])
        notify_node_changed(audit.node_id)
        if state == CheckState.FAILED:
            # The customer never pays for work found bad: the whole job's charge goes back.
            refund_charge(audit.job, f"refund: audit {audit.pk} of stage {audit.stage} failed")
            open_strike(
                audit.node,
                StrikeKind.AUDIT,
                audit=audit,
                evidence={
                    "kind": "audit",
                    "audit": audit.pk,
                    "job": audit.job.public_id,
                    "session": audit.session,
                    "stage": audit.stage,
                    "model": audit.model,
                    "layers": [audit.layer_start, audit.layer_end],
                    "reason": reason,
                    "job_finished_at": audit.job.finished_at.isoformat() if audit.job.finished_at else None,
                    "checked_at": audit.checked_at.isoformat(),
                    **metrics,
                },
            )
    return audit
