"""Reading one sample out of a Prometheus text exposition (what /metrics serves)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name` with exactly `labels`, or None if there is no such
    sample (a HELP or TYPE line names a metric whether or not it has samples)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None
