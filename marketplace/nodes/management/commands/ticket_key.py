"""``python -m marketplace ticket_key``: the public half of the key that signs job tickets and relay
passes, in hex, as a relay's ``--trust-key`` and an agent's ``--trust-key`` take it."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from marketplace.nodes.tickets import issuer_public_key


class Command(BaseCommand):
    help = "Print the public key (hex) of this control plane's ticket key: what swarm-relay --trust-key takes."

    def handle(self, *args, **options) -> None:
        self.stdout.write(issuer_public_key().hex())
