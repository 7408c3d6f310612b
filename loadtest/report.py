"""Results out: the rich table, the JSON file (schema in README.md) and the report directory."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

SCHEMA_VERSION = 1


def wide_console() -> Console:
    """A console wide enough for the table even when output goes to a file or a pipe."""
    c = Console()
    return c if c.is_terminal else Console(width=180)


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def focus_turn(policies: Mapping[str, Mapping[str, Any]]) -> int | None:
    """The turn the headline compares: the 5th if the workload has one, else its last (None: one turn)."""
    turns = {int(t) for p in policies.values() for t in p.get("ttft_by_turn", {})}
    if len(turns) <= 1:
        return None
    return 5 if 5 in turns else max(turns)


def turn_p50(summary: Mapping[str, Any], turn: int | None) -> float | None:
    if turn is None:
        return None
    return summary.get("ttft_by_turn", {}).get(str(turn), {}).get("ttft_p50_ms")


def results_table(result: Mapping[str, Any], title: str = "") -> Table:
    policies = result["policies"]
    turn = focus_turn(policies)
    t = Table(title=title or None, title_justify="left")
    pooled = any("hit_rate_of_oracle_pool" in s for s in policies.values())
    cols = ["policy", "requests", "errors", "hit rate", *(["% of\noracle_pool"] if pooled else []), "pulled",
            "redundant\nprefill",
            "TTFT p50\nms", "TTFT p90\nms", "TTFT p99\nms", "TPOT p50/p99\nms"]
    split = any(s.get("split_frac") for s in policies.values())
    if split:
        cols += ["split"]
    if turn is not None:
        cols += [f"turn {turn}\np50 ms"]
    cols += ["output\ntok/s", "req/s", "imbalance\nmax/mean", "decision\np50/p99 ms"]
    for c in cols:
        t.add_column(c, justify="left" if c == "policy" else "right")
    for name, s in policies.items():
        dec = "-" if s.get("decision_p50_ms") is None else f"{_ms(s['decision_p50_ms'])}/{_ms(s['decision_p99_ms'])}"
        row = [name, str(s["requests"]), str(s["errors"]), _pct(s["hit_rate"])]
        if pooled:
            row.append(_pct(s.get("hit_rate_of_oracle_pool")))
        row += [_pct(s["hit_rate_pulled"]), _pct(s["redundant_prefill_frac"]),
                _ms(s["ttft_p50_ms"]), _ms(s["ttft_p90_ms"]), _ms(s["ttft_p99_ms"]),
                f"{_ms(s.get('tpot_p50_ms'))}/{_ms(s.get('tpot_p99_ms'))}"]
        if split:
            row.append(_pct(s.get("split_frac")))
        if turn is not None:
            row.append(_ms(turn_p50(s, turn)))
        imb = "-" if s.get("imbalance") is None else f"{s['imbalance']:.2f}"
        row += [f"{s['throughput_tok_s']:,.0f}", f"{s['requests_per_s']:.2f}", imb, dec]
        t.add_row(*row)
    return t


def print_results(result: Mapping[str, Any], console: Console | None = None, title: str = "") -> None:
    console = console or Console()
    console.print(results_table(result, title))
    for name, reason in result.get("skipped", {}).items():
        console.print(f"[yellow]skipped {name}[/]: {reason}")
    for name, s in result["policies"].items():
        if s["errors"]:
            console.print(f"[red]{name}: {s['errors']} errors[/], e.g. {s['error_examples'][:1]}")


def write_json(result: Mapping[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"schema_version": SCHEMA_VERSION, **result}, indent=2, sort_keys=False))
    return p


def write_report(result: Mapping[str, Any], samples_ms: Mapping[str, Sequence[float]], directory: str | Path) -> Path:
    """PNG plots and an HTML page embedding them; returns the HTML path."""
    from loadtest.plots import write_html, write_plots  # matplotlib only when a report is asked for

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    write_json(result, d / "results.json")
    pngs = write_plots(result, samples_ms, d)
    return write_html(result, pngs, d)
