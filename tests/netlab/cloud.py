"""The control plane of a netlab run, started on the ``cloud`` host: ``python -m tests.netlab.cloud``.

It is the embedded control plane (``marketplace.embedded``, as ``make demo`` runs it) on PostgreSQL and
Redis reached over the namespace network, listening on every interface of ``cloud``, with its
settings from the environment the test gives it. It migrates the run's database, creates a provider
(with a password, for the API and the dashboard) and a customer with an API key and credits, starts
the web app, and writes what the test needs as one JSON object to ``--out``: the provider's login,
the customer's key and the ticket key relays must trust. It serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import threading
from pathlib import Path

NANO_PER_DOLLAR = 1_000_000_000


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")

    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)

    # Imported after django.setup(): models need the app registry.
    from django.contrib.auth import get_user_model

    from marketplace.billing.services import grant
    from marketplace.embedded import EmbeddedServer
    from marketplace.jobs.services import create_api_key
    from marketplace.nodes.tickets import issuer_public_key

    users = get_user_model()
    password = secrets.token_urlsafe(12)
    provider = users.objects.create_user("netlab-provider", "provider@example.com", password, is_provider=True)
    customer = users.objects.create_user("netlab-customer", "customer@example.com", is_customer=True)
    _, key = create_api_key(customer, "netlab")
    grant(customer, 5, memo="netlab credits")
    server = EmbeddedServer(args.port, "0.0.0.0").start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    answer = {
        "provider": {"username": provider.username, "password": password},
        "api_key": key,
        "ticket_key": issuer_public_key().hex(),
    }
    partial = args.out.with_suffix(".part")
    partial.write_text(json.dumps(answer))
    partial.rename(args.out)  # whole or absent: the test waits for it
    print(f"READY cloud port={args.port}", flush=True)
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
