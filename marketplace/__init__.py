"""The Django control plane of the swarm marketplace."""

from marketplace.celery import app as celery_app

__all__ = ["celery_app"]
