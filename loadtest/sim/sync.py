"""Call an async method that never suspends, synchronously.

The in-process directory's methods are ``async`` (one protocol for every backend) but never await
anything, so a coroutine of theirs finishes on its first step. The simulator has no event loop
and must not have one (nothing may sleep or be scheduled behind its virtual clock): it steps the
coroutine once and insists that it finished.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """The coroutine's result; ``RuntimeError`` if it tried to wait for something."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a directory call suspended: the simulator needs a backend that never awaits (memory://)")
