"""Reading a Prometheus exposition in tests: every sample by (name, labels), and deltas between two."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, frozenset]


def samples(body: str) -> dict[Key, float]:
    """Every sample of an exposition, by (sample name, labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def value(body: str, name: str, **labels: str) -> float:
    """One sample's value; a KeyError names it when the exposition lacks it."""
    return samples(body)[(name, frozenset(labels.items()))]


def moved(before: str, after: str, name: str, **labels: str) -> float:
    """How far a sample moved between two scrapes (a sample absent before counts from 0)."""
    key = (name, frozenset(labels.items()))
    return samples(after)[key] - samples(before).get(key, 0.0)


def label_values(body: str, name: str, label: str) -> set[str]:
    """The values ``label`` takes across the samples called ``name``."""
    return {dict(labels)[label] for sample, labels in samples(body) if sample == name}
