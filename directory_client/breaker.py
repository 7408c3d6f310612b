"""Stop calling a directory backend that keeps failing, and try it again after a backoff.

When Redis stalls or is down, every request would otherwise wait out the op timeout and leave a
half-used connection behind to be replaced: a storm of new connections against a server that is
already struggling, and the request path paying the timeout each time. After ``threshold``
consecutive failures the circuit *opens*: calls fail at once with ``DirectoryUnavailable`` (the
request fails open, as for any outage). After a backoff (``base_s``, doubling per failed probe up
to ``max_s``) one call at a time is let through as a probe; its success closes the circuit.
``kvgate_directory_circuit_open`` says which state a replica is in.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge

CIRCUIT_OPEN = Gauge("kvgate_directory_circuit_open", "1 while the directory's circuit is open: calls fail open without reaching Redis")
CIRCUIT_TRIPS = Counter("kvgate_directory_circuit_trips", "Times the directory's circuit opened after consecutive failures")
REFUSED = Counter("kvgate_directory_refused_calls", "Directory calls refused at once while the circuit was open")


class CircuitBreaker:
    """Closed → (``threshold`` failures) → open for a backoff → one probe → closed or open longer."""

    def __init__(
        self, *, threshold: int = 5, base_s: float = 0.5, max_s: float = 8.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.threshold = threshold
        self.base_s = base_s
        self.max_s = max_s
        self._clock = clock
        self._failures = 0  # consecutive
        self._backoff_s = base_s
        self._open_until: float | None = None  # None: closed
        self._probing = False

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    @property
    def retry_in_s(self) -> float:
        return 0.0 if self._open_until is None else max(0.0, self._open_until - self._clock())

    def allow(self) -> bool:
        """May a call go to the backend now? (While open, only one probe after the backoff.)"""
        if self._open_until is None:
            return True
        if self._probing or self._clock() < self._open_until:
            REFUSED.inc()
            return False
        self._probing = True
        return True

    def success(self) -> None:
        if self._open_until is not None:
            CIRCUIT_OPEN.set(0)
        self._failures = 0
        self._backoff_s = self.base_s
        self._open_until = None
        self._probing = False

    def failure(self) -> None:
        self._failures += 1
        if self._probing:  # the probe failed: stay open, twice as long
            self._probing = False
            self._backoff_s = min(self._backoff_s * 2, self.max_s)
            self._open_until = self._clock() + self._backoff_s
        elif self._open_until is None and self._failures >= self.threshold:
            self._open_until = self._clock() + self._backoff_s
            CIRCUIT_OPEN.set(1)
            CIRCUIT_TRIPS.inc()

    def abandon(self) -> None:
        """A call ended without an answer either way (cancelled): a probe may be sent again."""
        self._probing = False
