"""A small, stateful stand-in for the Stripe API, served over HTTP on 127.0.0.1 for the real SDK.

Stripe's servers cannot be reached from the tests, and localstripe answers 404 to Checkout Sessions
and Connect accounts, so this serves exactly what the marketplace calls, shaped like Stripe's answers
(form-encoded requests, JSON objects with ``id`` and ``object``, errors as ``{"error": {...}}``):

    POST /v1/checkout/sessions           GET /v1/checkout/sessions/{id}
    POST /v1/checkout/sessions/{id}/expire
    POST /v1/accounts                    GET /v1/accounts/{id}
    POST /v1/account_links
    POST /v1/transfers                   GET /v1/transfers/{id}
    POST /v1/transfers/{id}/reversals

It checks the secret key (401 otherwise) and honours ``Idempotency-Key`` as Stripe does: the same key
replays the first successful answer, the same key with other parameters is a 400 idempotency_error. It fails on
demand: ``fail_next(500)`` answers the next request with a 5xx (as if it never ran: nothing is stored
under its key), ``fail_next(402, error_type="card_error", code="card_declined")`` with a permanent
error, ``stall_next(seconds)`` runs the next request and then answers late (a client timeout after
Stripe did the work). ``requests`` lists every request received.

Stripe would then send webhook events: ``complete_session``, ``async_payment``, ``expire_session``,
``refund`` and ``dispute`` change the fake's state the way Stripe would and return the event (a dict)
to sign and post; ``sign`` makes its ``Stripe-Signature`` header.

    with FakeStripe(api_key="sk_test_fake") as fake:
        stripe.api_base = fake.url

Test modules load its ``fake_stripe`` fixture with ``pytest_plugins = ["tests.stripe_fake"]``; it holds
no test asserts, hence PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import pytest
import stripe
from django.test import Client

SECRET_KEY = "sk_test_swarm_fake_secret_key"
WEBHOOK_SECRET = "whsec_swarm_fake_webhook_secret"
API_VERSION = "2025-12-15.clover"


@dataclass(frozen=True)
class Received:
    """One request as the fake saw it: params decoded from Stripe's form encoding into dicts and lists."""

    method: str
    path: str
    params: dict
    headers: dict  # lower-cased names


@dataclass
class Failure:
    status: int
    error_type: str
    code: str | None
    message: str
    stall_s: float = 0.0  # > 0: run the request, then answer after this long


@dataclass
class Answer:
    status: int
    body: dict
    headers: dict = field(default_factory=dict)


class StripeApiError(Exception):
    def __init__(self, status: int, error_type: str, message: str, *, code: str | None = None, param=None) -> None:
        super().__init__(message)
        self.answer = Answer(status, {"error": {"type": error_type, "code": code, "message": message, "param": param}})


def decode_form(pairs: list[tuple[str, str]]) -> dict:
    """``line_items[0][price_data][currency]=usd`` and friends back into nested dicts and lists."""
    root: dict = {}
    for key, value in pairs:
        parts = re.findall(r"[^\[\]]+", key)
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return _lists(root)


def _lists(value):
    if not isinstance(value, dict):
        return value
    items = {key: _lists(item) for key, item in value.items()}
    if items and all(key.isdigit() for key in items):
        return [items[key] for key in sorted(items, key=int)]
    return items


def _integer(params: dict, name: str, *, minimum: int = 1) -> int:
    raw = params.get(name)
    if raw is None:
        raise StripeApiError(400, "invalid_request_error", f"Missing required param: {name}.", code="parameter_missing")
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise StripeApiError(
            400, "invalid_request_error", f"Invalid integer: {raw}", code="parameter_invalid_integer", param=name
        ) from None
    if value < minimum:
        raise StripeApiError(
            400, "invalid_request_error", f"{name} must be at least {minimum}", code="parameter_invalid_integer"
        )
    return value


class FakeStripe:
    def __init__(self, api_key: str = "sk_test_fake") -> None:
        self.api_key = api_key
        self.requests: list[Received] = []
        self.sessions: dict[str, dict] = {}
        self.charges: dict[str, dict] = {}
        self.accounts: dict[str, dict] = {}
        self.transfers: dict[str, dict] = {}
        self.disputes: dict[str, dict] = {}
        self._failures: list[Failure] = []
        self._idempotent: dict[str, tuple[str, dict, Answer]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> FakeStripe:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake._serve(self)

            def do_POST(self) -> None:
                fake._serve(self)

            def do_DELETE(self) -> None:
                fake._serve(self)

            def log_message(self, format: str, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-stripe", daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # --- failing on demand ----------------------------------------------------------------------

    def fail_next(
        self,
        status: int = 500,
        *,
        error_type: str | None = None,
        code: str | None = None,
        message: str | None = None,
        times: int = 1,
    ) -> None:
        """Answer the next ``times`` requests with this error instead of running them."""
        error_type = error_type or {402: "card_error", 429: "rate_limit_error"}.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
        message = message or f"Fake Stripe failure ({status} {error_type})"
        with self._lock:
            self._failures.extend(Failure(status, error_type, code, message) for _ in range(times))

    def stall_next(self, seconds: float) -> None:
        """Run the next request, then answer only after ``seconds``."""
        with self._lock:
            self._failures.append(Failure(0, "", None, "", stall_s=seconds))

    # --- HTTP -----------------------------------------------------------------------------------

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        url = urlsplit(handler.path)
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length).decode() if length else ""
        params = decode_form(parse_qsl(url.query, keep_blank_values=True) + parse_qsl(body, keep_blank_values=True))
        headers = {name.lower(): value for name, value in handler.headers.items()}
        received = Received(handler.command, url.path, params, headers)
        with self._lock:
            self.requests.append(received)
            failure = self._failures.pop(0) if self._failures else None
            if failure is not None and not failure.stall_s:
                answer = Answer(
                    failure.status,
                    {"error": {"type": failure.error_type, "code": failure.code, "message": failure.message}},
                    {"Stripe-Should-Retry": "true"} if failure.status >= 500 else {},
                )
            else:
                answer = self._answer(received)
        if failure is not None and failure.stall_s:
            time.sleep(failure.stall_s)
        payload = json.dumps(answer.body).encode()
        try:
            handler.send_response(answer.status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(payload)))
            handler.send_header("Request-Id", f"req_{next(self._ids):014d}")
            for name, value in answer.headers.items():
                handler.send_header(name, value)
            handler.end_headers()
            handler.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (a stalled answer)
            pass

    def _answer(self, received: Received) -> Answer:
        if received.headers.get("authorization") != f"Bearer {self.api_key}":
            return StripeApiError(401, "invalid_request_error", "Invalid API Key provided.").answer
        key = received.headers.get("idempotency-key") if received.method == "POST" else None
        if key is not None and key in self._idempotent:
            path, params, answer = self._idempotent[key]
            if (path, params) != (received.path, received.params):
                return StripeApiError(
                    400,
                    "idempotency_error",
                    "Keys for idempotent requests can only be used with the same parameters they were first used with.",
                ).answer
            return Answer(answer.status, answer.body, {"Idempotent-Replayed": "true"})
        try:
            answer = Answer(200, self._route(received.method, received.path, received.params))
        except StripeApiError as exc:  # refused before it ran: Stripe keeps no result under the key
            return exc.answer
        if key is not None:
            self._idempotent[key] = (received.path, received.params, answer)
        return answer

    def _route(self, method: str, path: str, params: dict) -> dict:
        routes = [
            ("POST", r"/v1/checkout/sessions", self._create_session),
            ("GET", r"/v1/checkout/sessions/(?P<id>[^/]+)", self._get("sessions", "checkout.session")),
            ("POST", r"/v1/checkout/sessions/(?P<id>[^/]+)/expire", self._expire_session),
            ("POST", r"/v1/accounts", self._create_account),
            ("GET", r"/v1/accounts/(?P<id>[^/]+)", self._get("accounts", "account")),
            ("POST", r"/v1/account_links", self._create_account_link),
            ("POST", r"/v1/transfers", self._create_transfer),
            ("GET", r"/v1/transfers/(?P<id>[^/]+)", self._get("transfers", "transfer")),
            ("POST", r"/v1/transfers/(?P<id>[^/]+)/reversals", self._create_reversal),
        ]
        for route_method, pattern, view in routes:
            match = re.fullmatch(pattern, path)
            if match and method == route_method:
                return view(params, **match.groupdict())
        raise StripeApiError(404, "invalid_request_error", f"Unrecognized request URL ({method}: {path}).")

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):014d}"

    def _get(self, store: str, name: str):
        def view(params: dict, id: str) -> dict:
            found = getattr(self, store).get(id)
            if found is None:
                raise StripeApiError(
                    404, "invalid_request_error", f"No such {name}: '{id}'", code="resource_missing", param="id"
                )
            return found

        return view

    # --- Checkout -------------------------------------------------------------------------------

    def _create_session(self, params: dict) -> dict:
        if params.get("mode") not in ("payment", "setup", "subscription"):
            raise StripeApiError(
                400, "invalid_request_error", "Missing required param: mode.", code="parameter_missing"
            )
        line_items = params.get("line_items")
        if not isinstance(line_items, list):
            raise StripeApiError(
                400,
                "invalid_request_error",
                "You must provide at least one line item.",
                code="parameter_missing",
                param="line_items",
            )
        currencies = {item.get("price_data", {}).get("currency") for item in line_items}
        if len(currencies) != 1 or None in currencies:
            raise StripeApiError(400, "invalid_request_error", "Every line item needs price_data[currency].")
        total = sum(
            _integer(item.get("price_data", {}), "unit_amount") * _integer(item, "quantity") for item in line_items
        )
        if total < 50:
            raise StripeApiError(
                400,
                "invalid_request_error",
                "The Checkout Session's total amount is too small.",
                code="amount_too_small",
            )
        session_id = self._new_id("cs_test")
        now = int(time.time())
        session = {
            "id": session_id,
            "object": "checkout.session",
            "amount_subtotal": total,
            "amount_total": total,
            "cancel_url": params.get("cancel_url"),
            "client_reference_id": params.get("client_reference_id"),
            "created": now,
            "currency": currencies.pop(),
            "customer": None,
            "expires_at": now + 24 * 3600,
            "livemode": False,
            "metadata": params.get("metadata", {}),
            "mode": params["mode"],
            "payment_intent": None,
            "payment_status": "unpaid",
            "status": "open",
            "success_url": params.get("success_url"),
            "url": f"https://checkout.stripe.com/c/pay/{session_id}",
        }
        self.sessions[session_id] = session
        return session

    def _expire_session(self, params: dict, id: str) -> dict:
        """The merchant expires an open session (the customer can no longer pay it); Stripe refuses
        one that is complete or already expired."""
        session = self._get("sessions", "checkout.session")(params, id)
        if session["status"] != "open":
            raise StripeApiError(
                400,
                "invalid_request_error",
                f'Only Checkout Sessions with a status in ["open"] can be expired. This Checkout Session has a '
                f'status of "{session["status"]}".',
            )
        session["status"] = "expired"
        return session

    # --- Connect (for payouts) ------------------------------------------------------------------

    def _create_account(self, params: dict) -> dict:
        account_id = self._new_id("acct")
        capabilities = {name: "inactive" for name in (params.get("capabilities") or {})}
        self.accounts[account_id] = {
            "id": account_id,
            "object": "account",
            "type": params.get("type", "express"),
            "country": params.get("country", "US"),
            "email": params.get("email"),
            "capabilities": capabilities,
            "charges_enabled": False,
            "payouts_enabled": False,
            "details_submitted": False,
            "metadata": params.get("metadata", {}),
            "created": int(time.time()),
        }
        return self.accounts[account_id]

    def complete_onboarding(self, account_id: str) -> dict:
        """The account's owner finished Stripe's onboarding: it can receive transfers."""
        with self._lock:
            account = self.accounts[account_id]
            account.update(details_submitted=True, charges_enabled=True, payouts_enabled=True)
            account["capabilities"] = {name: "active" for name in {*account["capabilities"], "transfers"}}
            return copy.deepcopy(account)

    def onboarded_account(self, email: str) -> str:
        """An account whose owner already finished onboarding, for a test that starts from one;
        its id."""
        with self._lock:
            account = self._create_account({"type": "express", "email": email, "capabilities": {"transfers": {}}})
        self.complete_onboarding(account["id"])
        return account["id"]

    def _create_account_link(self, params: dict) -> dict:
        account_id = params.get("account")
        if account_id not in self.accounts:
            raise StripeApiError(
                400,
                "invalid_request_error",
                f"No such account: '{account_id}'",
                code="resource_missing",
                param="account",
            )
        now = int(time.time())
        return {
            "object": "account_link",
            "created": now,
            "expires_at": now + 300,
            "url": f"https://connect.stripe.com/setup/e/{account_id}/{self._new_id('link')}",
        }

    def _create_transfer(self, params: dict) -> dict:
        amount = _integer(params, "amount")
        destination = self.accounts.get(params.get("destination"))
        if destination is None:
            raise StripeApiError(
                400,
                "invalid_request_error",
                f"No such destination: '{params.get('destination')}'",
                code="resource_missing",
                param="destination",
            )
        if destination["capabilities"].get("transfers") != "active":
            raise StripeApiError(
                400,
                "invalid_request_error",
                "Your destination account needs to have at least one of the following capabilities enabled: "
                "transfers, crypto_transfers, legacy_payments",
                code="insufficient_capabilities_for_transfer",
                param="destination",
            )
        transfer_id = self._new_id("tr")
        self.transfers[transfer_id] = {
            "id": transfer_id,
            "object": "transfer",
            "amount": amount,
            "amount_reversed": 0,
            "created": int(time.time()),
            "currency": params.get("currency", "usd"),
            "description": params.get("description"),
            "destination": destination["id"],
            "livemode": False,
            "metadata": params.get("metadata", {}),
            "reversals": {
                "object": "list",
                "data": [],
                "has_more": False,
                "total_count": 0,
                "url": f"/v1/transfers/{transfer_id}/reversals",
            },
            "reversed": False,
            "transfer_group": params.get("transfer_group"),
        }
        return self.transfers[transfer_id]

    def _create_reversal(self, params: dict, id: str) -> dict:
        transfer = self._get("transfers", "transfer")(params, id)
        remaining = transfer["amount"] - transfer["amount_reversed"]
        amount = _integer(params, "amount") if "amount" in params else remaining
        if amount > remaining:
            raise StripeApiError(
                400,
                "invalid_request_error",
                f"Requested reversal amount ({amount}) exceeds the unreversed amount ({remaining}).",
                param="amount",
            )
        reversal = {
            "id": self._new_id("trr"),
            "object": "transfer_reversal",
            "amount": amount,
            "created": int(time.time()),
            "currency": transfer["currency"],
            "metadata": params.get("metadata", {}),
            "transfer": id,
        }
        transfer["amount_reversed"] += amount
        transfer["reversed"] = transfer["amount_reversed"] == transfer["amount"]
        transfer["reversals"]["data"].insert(0, reversal)
        transfer["reversals"]["total_count"] += 1
        return reversal

    # --- what Stripe then reports (webhook events) ----------------------------------------------

    def event(self, event_type: str, obj: dict) -> dict:
        """A webhook event as Stripe sends it, about a snapshot of ``obj``."""
        return {
            "id": self._new_id("evt"),
            "object": "event",
            "api_version": API_VERSION,
            "created": int(time.time()),
            "data": {"object": copy.deepcopy(obj)},
            "livemode": False,
            "pending_webhooks": 1,
            "request": {"id": None, "idempotency_key": None},
            "type": event_type,
        }

    def _pay(self, session: dict) -> None:
        if session["payment_intent"] is None:
            session["payment_intent"] = self._new_id("pi")
        charge_id = self._new_id("ch")
        self.charges[charge_id] = {
            "id": charge_id,
            "object": "charge",
            "amount": session["amount_total"],
            "amount_captured": session["amount_total"],
            "amount_refunded": 0,
            "currency": session["currency"],
            "payment_intent": session["payment_intent"],
            "paid": True,
            "refunded": False,
            "disputed": False,
            "status": "succeeded",
        }

    def complete_session(self, session_id: str, *, payment_status: str = "paid") -> dict:
        """The customer went through Checkout; "unpaid" is a delayed payment method still clearing."""
        with self._lock:
            session = self.sessions[session_id]
            session.update(status="complete", payment_status=payment_status)
            if payment_status == "paid":
                self._pay(session)
            elif session["payment_intent"] is None:
                session["payment_intent"] = self._new_id("pi")
            return self.event("checkout.session.completed", session)

    def async_payment(self, session_id: str, *, succeeded: bool) -> dict:
        with self._lock:
            session = self.sessions[session_id]
            if succeeded:
                session["payment_status"] = "paid"
                self._pay(session)
                return self.event("checkout.session.async_payment_succeeded", session)
            return self.event("checkout.session.async_payment_failed", session)

    def expire_session(self, session_id: str) -> dict:
        with self._lock:
            session = self.sessions[session_id]
            session["status"] = "expired"
            return self.event("checkout.session.expired", session)

    def charge_for(self, session_id: str) -> dict:
        payment_intent = self.sessions[session_id]["payment_intent"]
        return next(charge for charge in self.charges.values() if charge["payment_intent"] == payment_intent)

    def refund(self, session_id: str, cents: int | None = None) -> dict:
        """Refund ``cents`` (all that is left by default) of the session's charge."""
        with self._lock:
            charge = self.charge_for(session_id)
            left = charge["amount"] - charge["amount_refunded"]
            charge["amount_refunded"] += left if cents is None else min(cents, left)
            charge["refunded"] = charge["amount_refunded"] == charge["amount"]
            return self.event("charge.refunded", charge)

    def dispute(self, session_id: str, cents: int | None = None, *, reason: str = "fraudulent") -> dict:
        with self._lock:
            charge = self.charge_for(session_id)
            charge["disputed"] = True
            dispute = {
                "id": self._new_id("du"),
                "object": "dispute",
                "amount": charge["amount"] if cents is None else cents,
                "charge": charge["id"],
                "currency": charge["currency"],
                "payment_intent": charge["payment_intent"],
                "reason": reason,
                "status": "needs_response",
            }
            self.disputes[dispute["id"]] = dispute
            return self.event("charge.dispute.created", dispute)

    def close_dispute(self, dispute_id: str, status: str) -> dict:
        """The card issuer decided: "won" (the money stays with the merchant), "lost" (it went
        back to the cardholder) or "warning_closed" (an inquiry that never became a chargeback)."""
        with self._lock:
            dispute = self.disputes[dispute_id]
            dispute["status"] = status
            return self.event("charge.dispute.closed", dispute)


def sign(payload: str, secret: str, timestamp: int | None = None) -> str:
    """The ``Stripe-Signature`` header Stripe would send for ``payload``: t=...,v1=HMAC-SHA256."""
    return stripe.WebhookSignature.generate_signature_header(payload, secret, timestamp=timestamp)


@pytest.fixture
def fake_stripe(settings):
    """A fake Stripe on 127.0.0.1 with the settings pointing at it; the SDK's globals are restored after."""
    saved = (stripe.api_key, stripe.api_base, stripe.max_network_retries, stripe.default_http_client)
    try:
        with FakeStripe(api_key=SECRET_KEY) as fake:
            settings.STRIPE_API_BASE = fake.url
            settings.STRIPE_SECRET_KEY = SECRET_KEY
            settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
            settings.STRIPE_TIMEOUT_S = 5.0
            settings.STRIPE_MAX_RETRIES = 2
            settings.STRIPE_RETRY_BACKOFF_S = 0.0
            settings.STRIPE_WEBHOOK_TOLERANCE_S = 300
            yield fake
    finally:
        stripe.api_key, stripe.api_base, stripe.max_network_retries, stripe.default_http_client = saved


def deliver(
    event: dict | str, *, secret: str = WEBHOOK_SECRET, timestamp: int | None = None, signature: str | bool = ""
):
    """POST an event to /stripe/webhook as Stripe does: the raw JSON body, signed with ``secret`` at
    ``timestamp`` (now by default); ``signature`` replaces that header, or with False leaves it out."""
    payload = event if isinstance(event, str) else json.dumps(event)
    headers = {} if signature is False else {"HTTP_STRIPE_SIGNATURE": signature or sign(payload, secret, timestamp)}
    return Client().post("/stripe/webhook", data=payload, content_type="application/json", **headers)
