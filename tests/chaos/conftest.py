"""Chaos tests print one table at the end of the run: what each fault did to the steady load."""

from __future__ import annotations

import pytest

from tests.chaos.harness import ChaosFleet
from tests.chaos.load import Row, render_table

ROWS: list[Row] = []


@pytest.fixture(scope="module")
def fleet():
    """One whole fleet per chaos module (tests/chaos/harness.py), stopped by pid at its end."""
    f = ChaosFleet().start()
    try:
        yield f
    finally:
        f.stop()


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 (pytest's reporter type is private)
    if not ROWS:
        return
    terminalreporter.write_sep("=", "chaos: steady load through Envoy while parts fail")
    terminalreporter.write_line(render_table(ROWS))
    for row in ROWS:
        for note in row.notes:
            terminalreporter.write_line(f"  {row.event}: {note}")
