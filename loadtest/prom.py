"""Read figures out of Prometheus text: kvgate's decision-latency histogram, engines' busy time.

Quantiles come from histogram buckets the way Prometheus' ``histogram_quantile`` computes them
(linear interpolation inside the bucket that holds the rank), on the *difference* between two
scrapes, so a run's figure is not mixed with what happened before it.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families


def histogram_buckets(text: str, name: str, labels: Mapping[str, str]) -> dict[float, float]:
    """Cumulative bucket counts ``{le: count}`` of histogram ``name`` with ``labels``."""
    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if not s.name.endswith("_bucket"):
                continue
            if any(s.labels.get(k) != v for k, v in labels.items()):
                continue
            out[float(s.labels["le"])] = s.value
    return out


def counter_value(text: str, name: str) -> float:
    """Sum of a counter's samples (``name`` without ``_total``)."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            total += sum(s.value for s in fam.samples if s.name in (name, name + "_total"))
    return total


def histogram_sum_count(text: str, name: str) -> tuple[float, float]:
    """``(sum, count)`` of histogram ``name`` over all its label sets (0, 0 when absent)."""
    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                if s.name == name + "_sum":
                    total += s.value
                elif s.name == name + "_count":
                    count += s.value
    return total, count


def bucket_delta(after: Mapping[float, float], before: Mapping[float, float]) -> dict[float, float]:
    return {le: c - before.get(le, 0.0) for le, c in after.items()}


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``{le: count}``; None when empty."""
    if not buckets:
        return None
    items = sorted(buckets.items())
    total = items[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in items:
        if count >= rank:
            if le == float("inf"):
                return prev_le  # the highest finite bound, as Prometheus answers
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le
