"""The report's picture of a run with scale events: hit rate and TTFT p99 per minute, per policy,
with the events marked (``loadtest.elastic_figures``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def scale_timeline(policies: Mapping[str, Mapping[str, Any]], path: Path) -> Path | None:
    """Two panels over virtual minutes; None when no policy ran with scale events."""
    runs = {name: s for name, s in policies.items() if s.get("timeline")}
    if not runs:
        return None
    fig, (hit, ttft) = plt.subplots(2, 1, figsize=(8, 6.4), sharex=True)
    for name, s in runs.items():
        rows = s["timeline"]
        mid = [(r["start_s"] + 30) / 60 for r in rows]
        hit.plot(mid, [100 * r["hit_rate"] if r["hit_rate"] is not None else float("nan") for r in rows],
                 marker=".", label=name)  # fmt: skip
        ttft.plot(mid, [r["ttft_p99_ms"] if r["ttft_p99_ms"] is not None else float("nan") for r in rows],
                  marker=".", label=name)  # fmt: skip
    any_run = next(iter(runs.values()))
    for e in any_run.get("scale_out_events", []):
        for ax in (hit, ttft):
            ax.axvline(e["at_s"] / 60, color="green", linestyle="--", alpha=0.6)
    for e in any_run.get("scale_in_events", []):
        for ax in (hit, ttft):
            ax.axvline(e["at_s"] / 60, color="red", linestyle="--", alpha=0.6)
    hit.set_ylabel("hit rate (%)")
    hit.set_title("per minute around scale events (green: nodes added, red: removed)")
    hit.grid(True, alpha=0.3)
    hit.legend(fontsize=8)
    ttft.set_yscale("log")
    ttft.set_ylabel("TTFT p99 (ms, log)")
    ttft.set_xlabel("virtual minute")
    ttft.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
