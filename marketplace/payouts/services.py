"""Earnings and payouts: from a verified job's charge to a Stripe Connect transfer.

Every step is one atomic set of balanced ledger transfers plus the rows that explain it:

    job settled and verified   platform_revenue   -> provider_pending    (charge minus the fee, per node)
    challenge window passed    provider_pending   -> provider_available  (no open strike on the node)
    strike upheld              provider_pending   -> platform_revenue    (claw-back of the node's pending pay)
    batch built                provider_available -> provider_payout     (providers above the minimum, with
                                                                          earlier payouts' sub-cent rests)
    transfer sent              provider_payout    -> payouts             (whole cents; sub-cent rest back)
    transfer given up          provider_payout    -> provider_available  (flagged for admins)

Only a job whose receipts the control plane verifies itself pays anyone (``flows.settlement``
verifies them and passes each node's layer-tokens here); an unverified one pays nobody.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import stripe
from django.conf import settings
from django.db import transaction
from django.db.models import F, QuerySet, Sum
from django.urls import reverse
from django.utils import timezone

from marketplace.accounts import notices
from marketplace.billing import stripe_client
from marketplace.billing.display import usd_text
from marketplace.billing.models import AccountKind, LedgerAccount
from marketplace.billing.services import Move, account, accounts, transfer, transfer_many
from marketplace.billing.stripe_client import PAYOUTS_UNAVAILABLE, PaymentProviderUnavailable, call_stripe
from marketplace.nodes.models import Node
from marketplace.payouts.errors import PayoutRefused
from marketplace.payouts.models import (
    BatchState,
    ConnectAccount,
    Earning,
    EarningState,
    Payout,
    PayoutBatch,
    PayoutState,
)

log = logging.getLogger("swarm.payouts")

NANO_PER_CENT = 10_000_000


def split(pool: int, weights: dict[str, int]) -> dict[str, int]:
    """Split ``pool`` nano-dollars in proportion to ``weights`` (largest remainder: the parts sum to
    ``pool`` exactly; ties go to the first key in sorted order)."""
    total = sum(weights.values())
    if pool <= 0 or total <= 0:
        return dict.fromkeys(weights, 0)
    shares = {key: pool * weight // total for key, weight in weights.items()}
    rest = pool - sum(shares.values())
    by_remainder = sorted(weights, key=lambda key: (-(pool * weights[key] % total), key))
    for key in by_remainder[:rest]:
        shares[key] += 1
    return shares


def credit_earnings(
    job, layer_tokens_by_node: dict[str, int], *, worth: int | None = None, memo: str = ""
) -> list[Earning]:
    """Called inside the settlement's transaction (``flows.settlement``): pay a settled job's stages
    from its charge, in proportion to the layer-tokens its verified receipts show each node served.
    ``worth``: what the work was worth when the customer was charged nothing for it (a job left
    unverified by one node's lie): the platform pays the honest stages their shares of that, from
    its revenue (the liar's clawed-back pay goes the other way)."""
    pool = job.charged_amount if worth is None else worth
    if pool <= 0 or Earning.objects.filter(job=job).exists():
        return []
    fee = pool * settings.SWARM_PLATFORM_FEE_BPS // 10_000
    shares = split(pool - fee, layer_tokens_by_node)
    nodes = {n.node_id: n for n in Node.objects.filter(node_id__in=list(shares))}
    available_at = (job.finished_at or timezone.now()) + timedelta(seconds=settings.SWARM_CHALLENGE_WINDOW_S)
    found = accounts(
        [(AccountKind.PLATFORM_REVENUE, None)] + [(AccountKind.PROVIDER_PENDING, n.owner_id) for n in nodes.values()]
    )
    revenue = found[(AccountKind.PLATFORM_REVENUE, None)]
    earnings, moves = [], []
    for node_id, amount in sorted(shares.items()):
        node = nodes.get(node_id)
        if node is None:  # deleted by its owner since (or never registered): nobody to pay, it stays revenue
            log.warning("job %s: node %s is not in the registry; its share of %d stays revenue", job.public_id,
                        node_id, amount)  # fmt: skip
            continue
        earnings.append(
            Earning(
                node=node,
                provider_id=node.owner_id,
                job=job,
                amount=amount,
                layer_tokens=layer_tokens_by_node[node_id],
                available_at=available_at,
            )
        )
        if amount:
            pending = found[(AccountKind.PROVIDER_PENDING, node.owner_id)]
            moves.append(Move(revenue, pending, amount, kind="earning", job=job, memo=f"node {node_id}{memo}"[:255]))
    earnings = Earning.objects.bulk_create(earnings)
    transfer_many(moves)
    return earnings


def release_earnings(now=None, *, withheld: Iterable[int] | QuerySet[Any, Any] = (), unless=None) -> int:
    """Earnings whose challenge window has passed become available, except those of the ``withheld``
    node pks and those matching ``unless`` (a condition on an earning; verification passes the
    nodes with an open strike and the jobs whose audits are not all passed:
    ``verification.strikes.release_earnings_in_good_standing``). Returns how many were released."""
    now = now or timezone.now()
    due = Earning.objects.filter(state=EarningState.PENDING, available_at__lte=now).exclude(node_id__in=withheld)
    if unless is not None:
        due = due.exclude(unless)
    released = 0
    for pk in list(due.values_list("pk", flat=True)):
        with transaction.atomic():
            earning = Earning.objects.select_for_update().get(pk=pk)
            if earning.state != EarningState.PENDING:
                continue
            earning.state = EarningState.AVAILABLE
            earning.save(update_fields=["state"])
            if earning.amount:
                transfer(
                    account(AccountKind.PROVIDER_PENDING, earning.provider_id),
                    account(AccountKind.PROVIDER_AVAILABLE, earning.provider_id),
                    earning.amount,
                    kind="earning_release",
                    job=earning.job,
                    memo=f"earning {earning.pk}",
                )
            released += 1
    return released


def claw_back(node: Node, strike) -> int:
    """Inside the strike's transaction: take back every pending earning of the node. Returns the amount."""
    total = 0
    for earning in Earning.objects.select_for_update().filter(node=node, state=EarningState.PENDING).order_by("pk"):
        earning.state = EarningState.CLAWED_BACK
        earning.strike = strike
        earning.save(update_fields=["state", "strike"])
        if earning.amount:
            transfer(
                account(AccountKind.PROVIDER_PENDING, earning.provider_id),
                account(AccountKind.PLATFORM_REVENUE),
                earning.amount,
                kind="clawback",
                memo=f"strike {strike.pk}, earning {earning.pk}",
            )
        total += earning.amount
    return total


# --- Stripe Connect onboarding --------------------------------------------------------------------


def start_onboarding(provider, *, origin: str) -> str:
    """The provider's Stripe Connect account (created once) and a fresh Account Link to onboard it;
    Stripe sends the provider back to their earnings page at ``origin`` (this site's address as they
    reached it, or SWARM_PUBLIC_URL): ``?connect=done``, or ``?connect=refresh`` when the link expired."""
    if not provider.is_provider:
        raise PayoutRefused("only providers connect a payout account")
    if not stripe_client.configured():
        raise PaymentProviderUnavailable(PAYOUTS_UNAVAILABLE)
    connect = ConnectAccount.objects.filter(provider=provider).first()
    if connect is None:
        created = call_stripe(
            lambda: stripe.Account.create(
                type="express",
                email=provider.email,
                capabilities={"transfers": {"requested": True}},
                metadata={"provider": str(provider.pk)},
                idempotency_key=f"connect-account-{provider.pk}",
            ),
            what="account creation",
        )
        connect, _ = ConnectAccount.objects.get_or_create(provider=provider, defaults={"stripe_account_id": created.id})
    earnings = f"{origin}{reverse('web:earnings')}"
    link = call_stripe(
        lambda: stripe.AccountLink.create(
            account=connect.stripe_account_id,
            refresh_url=f"{earnings}?connect=refresh",
            return_url=f"{earnings}?connect=done",
            type="account_onboarding",
        ),
        what="account link",
    )
    return link.url


def refresh_connect(provider) -> ConnectAccount | None:
    """Ask Stripe whether the provider's account can receive transfers yet."""
    connect = ConnectAccount.objects.filter(provider=provider).first()
    if connect is None:
        return None
    remote = call_stripe(lambda: stripe.Account.retrieve(connect.stripe_account_id), what="account lookup").to_dict()
    _apply_account(connect, remote)
    return connect


def connect_account_updated(account: dict) -> str:
    """Stripe's ``account.updated`` webhook (already verified): record whether the account can
    receive transfers now. Returns "connect_updated", or "ignored" for an account not ours."""
    connect = ConnectAccount.objects.filter(stripe_account_id=str(account.get("id", ""))).first()
    if connect is None:
        return "ignored"
    _apply_account(connect, account)
    return "connect_updated"


def _apply_account(connect: ConnectAccount, remote: dict) -> None:
    capabilities = remote.get("capabilities") or {}
    connect.payouts_enabled = bool(remote.get("payouts_enabled")) and capabilities.get("transfers") == "active"
    connect.details_submitted = bool(remote.get("details_submitted"))
    connect.refreshed_at = timezone.now()
    connect.save(update_fields=["payouts_enabled", "details_submitted", "refreshed_at"])


# --- batches and transfers ------------------------------------------------------------------------


def carried_rest(provider_id: int) -> int:
    """The sub-cent rests of the provider's sent payouts (each transfer carries whole cents, the
    rest stayed available) not yet carried into a later payout: nano-dollars, in its available
    account but in no earning. A failed payout gave its whole amount back, so what it carried is
    due again."""
    payouts = Payout.objects.filter(provider_id=provider_id)
    rests = payouts.filter(state=PayoutState.SENT).aggregate(total=Sum(F("amount") - F("cents") * NANO_PER_CENT))[
        "total"
    ]
    carried = payouts.exclude(state=PayoutState.FAILED).aggregate(total=Sum("carried_in"))["total"]
    return max(0, (rests or 0) - (carried or 0))


@transaction.atomic
def build_batch() -> PayoutBatch | None:
    """Gather the available earnings of every provider above the minimum with a payout-ready
    account into one batch awaiting an admin's approval; None when nobody is due. Each payout also
    carries the sub-cent rests of the provider's earlier payouts (``carried_rest``), so no part
    of a cent is left behind for good."""
    ready = set(ConnectAccount.objects.filter(payouts_enabled=True).values_list("provider_id", flat=True))
    batch = None
    for provider_id in sorted(ready):
        earnings = list(
            Earning.objects.select_for_update()
            .filter(provider_id=provider_id, state=EarningState.AVAILABLE, payout__isnull=True)
            .order_by("pk")
        )
        # Lock the provider's accounts (in primary-key order, as transfers do) before reading the
        # rests, so two batches built at once cannot both carry them.
        accounts = [
            account(kind, provider_id) for kind in (AccountKind.PROVIDER_AVAILABLE, AccountKind.PROVIDER_PAYOUT)
        ]
        list(LedgerAccount.objects.select_for_update().filter(pk__in=[a.pk for a in accounts]).order_by("pk"))
        carried = carried_rest(provider_id)
        amount = sum(e.amount for e in earnings) + carried
        if amount < settings.SWARM_PAYOUT_MINIMUM or amount < NANO_PER_CENT:
            continue
        if batch is None:
            batch = PayoutBatch.objects.create()
        payout = Payout.objects.create(
            batch=batch,
            provider_id=provider_id,
            amount=amount,
            cents=amount // NANO_PER_CENT,
            carried_in=carried,
            idempotency_key=f"payout-{batch.pk}-{provider_id}",
        )
        Earning.objects.filter(pk__in=[e.pk for e in earnings]).update(state=EarningState.BATCHED, payout=payout)
        transfer(
            account(AccountKind.PROVIDER_AVAILABLE, provider_id),
            account(AccountKind.PROVIDER_PAYOUT, provider_id),
            amount,
            kind="payout_reserve",
            memo=f"payout {payout.pk} in batch {batch.pk}",
        )
        batch.total += amount
    if batch is not None:
        batch.save(update_fields=["total"])
    return batch


def build_batch_if_due(now=None) -> PayoutBatch | None:
    """The embedded stand-in for beat's daily batch: build one when the last is older than the interval."""
    now = now or timezone.now()
    last = PayoutBatch.objects.order_by("-created_at").values_list("created_at", flat=True).first()
    if last is not None and (now - last).total_seconds() < settings.SWARM_PAYOUT_BATCH_INTERVAL_S:
        return None
    return build_batch()


@transaction.atomic
def approve_batch(batch: PayoutBatch, *, by) -> PayoutBatch:
    """An admin approves a built batch; its transfers go out after commit."""
    if by is None or not by.is_staff:
        raise PayoutRefused("only admins approve payout batches")
    if not PayoutBatch.objects.filter(pk=batch.pk, state=BatchState.BUILT).update(
        state=BatchState.APPROVED, approved_at=timezone.now(), approved_by=by
    ):
        batch.refresh_from_db()
        raise PayoutRefused(f"batch {batch.pk} is {batch.get_state_display()}, not awaiting approval")
    batch.payouts.filter(state=PayoutState.PENDING).update(state=PayoutState.APPROVED)
    transaction.on_commit(send_payouts)
    batch.refresh_from_db()
    return batch


def send_payouts() -> dict:
    """Send every approved payout (periodic, and after an approval); returns counts by outcome."""
    outcomes = {"sent": 0, "retry": 0, "failed": 0}
    for pk in list(Payout.objects.filter(state=PayoutState.APPROVED).values_list("pk", flat=True)):
        outcomes[send_payout(pk)] += 1
    for batch in PayoutBatch.objects.filter(state=BatchState.APPROVED):
        if not batch.payouts.filter(state__in=[PayoutState.PENDING, PayoutState.APPROVED]).exists():
            PayoutBatch.objects.filter(pk=batch.pk, state=BatchState.APPROVED).update(state=BatchState.DONE)
    return outcomes


def send_payout(payout_pk: int) -> str:
    """One Stripe Connect transfer, with the payout's idempotency key (a retry can never pay twice).
    Returns "sent", "retry" (transient failure, attempts left) or "failed" (given up, flagged)."""
    with transaction.atomic():
        payout = Payout.objects.select_for_update().get(pk=payout_pk)
        if payout.state != PayoutState.APPROVED:
            return "sent" if payout.state == PayoutState.SENT else "failed"
        payout.attempts += 1
        payout.save(update_fields=["attempts"])
    connect = ConnectAccount.objects.filter(provider_id=payout.provider_id).first()
    error, permanent = "", False
    result = None
    if connect is None or not connect.payouts_enabled:
        error, permanent = "the provider has no payout-ready Stripe account", True
    else:
        try:
            result = call_stripe(
                lambda: stripe.Transfer.create(
                    amount=payout.cents,
                    currency="usd",
                    destination=connect.stripe_account_id,
                    transfer_group=f"batch-{payout.batch_id}",
                    metadata={"payout": str(payout.pk), "batch": str(payout.batch_id)},
                    idempotency_key=payout.idempotency_key,
                ),
                what="payout transfer",
            )
        except PaymentProviderUnavailable as exc:
            error = f"{exc} ({exc.__cause__!r})"
        except stripe.StripeError as exc:
            error, permanent = f"Stripe refused the transfer: {exc.user_message or exc}", True
    with transaction.atomic():
        payout = Payout.objects.select_for_update().get(pk=payout_pk)
        if payout.state != PayoutState.APPROVED:
            return "sent" if payout.state == PayoutState.SENT else "failed"
        reserved = account(AccountKind.PROVIDER_PAYOUT, payout.provider_id)
        if result is not None:
            sent = payout.cents * NANO_PER_CENT
            if sent:
                transfer(reserved, account(AccountKind.PAYOUTS), sent, kind="payout", reference=result.id)
            if payout.amount - sent:
                transfer(
                    reserved,
                    account(AccountKind.PROVIDER_AVAILABLE, payout.provider_id),
                    payout.amount - sent,
                    kind="payout_rest",
                    memo=f"payout {payout.pk}: the part below a cent stays available",
                )
            payout.state, payout.stripe_transfer_id, payout.sent_at = PayoutState.SENT, result.id, timezone.now()
            payout.last_error = ""
            payout.save()
            payout.earnings.update(state=EarningState.PAID)
            paid = usd_text(Decimal(payout.cents) / 100)
            notices.notify(
                payout.provider_id,
                f"Payout sent: {paid}",
                f"{paid} went to your Stripe account (transfer {result.id}). "
                "What was below a cent stays available for the next payout.",
            )
            return "sent"
        payout.last_error = error[:2000]
        if not permanent and payout.attempts < settings.SWARM_PAYOUT_MAX_ATTEMPTS:
            payout.save(update_fields=["last_error"])
            log.warning("payout %s failed (attempt %d), will retry: %s", payout.pk, payout.attempts, error)
            return "retry"
        payout.state, payout.flagged = PayoutState.FAILED, True
        payout.save(update_fields=["state", "flagged", "last_error"])
        transfer(
            reserved,
            account(AccountKind.PROVIDER_AVAILABLE, payout.provider_id),
            payout.amount,
            kind="payout_failed",
            memo=f"payout {payout.pk} given up: {error[:200]}",
        )
        payout.earnings.update(state=EarningState.AVAILABLE, payout=None)
        log.warning("payout %s given up after %d attempts: %s", payout.pk, payout.attempts, error)
        return "failed"
