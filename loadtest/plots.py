"""The report's pictures (matplotlib, Agg backend: no display needed) and the page that shows them."""

from __future__ import annotations

import html
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.elastic_plots import scale_timeline  # noqa: E402
from loadtest.report import focus_turn  # noqa: E402


def ttft_cdf(samples_ms: Mapping[str, Sequence[float]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, vals in samples_ms.items():
        if not len(vals):
            continue
        x = np.sort(np.asarray(vals))
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def hit_rates(policies: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    names = list(policies)
    local = [100 * policies[n]["hit_rate_local"] for n in names]
    pulled = [100 * policies[n]["hit_rate_pulled"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.bar(names, local, label="local hit")
    ax.bar(names, pulled, bottom=local, label="pulled")
    for i, n in enumerate(names):
        ax.text(i, local[i] + pulled[i] + 1, f"{local[i] + pulled[i]:.1f}%", ha="center")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 105)
    ax.set_title("prefix hit rate per policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_by_turn(policies: Mapping[str, Mapping[str, Any]], path: Path) -> Path | None:
    if focus_turn(policies) is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, s in policies.items():
        turns = sorted(int(t) for t in s.get("ttft_by_turn", {}))
        p50 = [s["ttft_by_turn"][str(t)]["ttft_p50_ms"] for t in turns]
        ax.plot(turns, p50, marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms, log scale)")
    ax.set_title("TTFT by turn")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: Mapping[str, Any], samples_ms: Mapping[str, Sequence[float]], d: Path) -> list[Path]:
    pols = result["policies"]
    out = [ttft_cdf(samples_ms, d / "ttft_cdf.png"), hit_rates(pols, d / "hit_rate.png")]
    by_turn = ttft_by_turn(pols, d / "ttft_by_turn.png")
    if by_turn is not None:
        out.append(by_turn)
    scaled = scale_timeline(pols, d / "scale_timeline.png")
    if scaled is not None:
        out.append(scaled)
    return out


def write_html(result: Mapping[str, Any], pngs: Sequence[Path], d: Path) -> Path:
    from loadtest.report import results_table
    from rich.console import Console

    console = Console(record=True, width=160, file=io.StringIO())
    console.print(results_table(result))
    table_html = console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")
    wl = result.get("workload", {})
    imgs = "\n".join(f'<figure><img src="{p.name}" alt="{p.stem}"><figcaption>{p.stem}</figcaption></figure>' for p in pngs)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvgate load test: {html.escape(str(wl.get('name', '')))}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}} figure{{display:inline-block;margin:1em}}
img{{max-width:560px}} code{{background:#eee}}</style></head><body>
<h1>kvgate load test ({html.escape(str(result.get('kind', '')))})</h1>
<p><b>workload</b>: {html.escape(str(wl.get('description', '')))}</p>
<p><b>fleet</b>: {html.escape(str(result.get('fleet', {})))}</p>
<p><b>command</b>: <code>{html.escape(str(result.get('command', '')))}</code></p>
{table_html}
{imgs}
<p>Raw figures: <a href="results.json">results.json</a>.</p>
</body></html>
"""
    path = d / "index.html"
    path.write_text(page)
    return path
