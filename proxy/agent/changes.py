"""Changes that arrived and are not applied yet: counts for the `*_changes_pending`
gauges, and arrival times for the network programming latency.

Upstream counts pending changes per service (a service with ten slice updates is one
pending endpoints change); so do we. Arrival times are kept per service, earliest first:
the latency of a sync is measured from the first change it applies for that service.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

ServiceRef = tuple[str, str]  # (namespace, name)


@dataclass(slots=True)
class ChangeBatch:
    services: set[ServiceRef] = field(default_factory=set)
    endpoints: set[ServiceRef] = field(default_factory=set)
    arrivals: dict[ServiceRef, float] = field(default_factory=dict)

    def merge(self, other: ChangeBatch) -> None:
        self.services |= other.services
        self.endpoints |= other.endpoints
        for ref, at in other.arrivals.items():
            if ref not in self.arrivals or at < self.arrivals[ref]:
                self.arrivals[ref] = at


class ChangeLog:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._batch = ChangeBatch()

    def _arrived(self, ref: ServiceRef) -> None:
        self._batch.arrivals.setdefault(ref, self._clock())

    def service(self, namespace: str, name: str) -> None:
        ref = (namespace, name)
        self._batch.services.add(ref)
        self._arrived(ref)

    def endpoints(self, namespace: str, service: str | None, source: str) -> None:
        """A slice or Endpoints event; `service` is None when it is not known (a slice
        deleted while we were not watching): counted, but not timed."""
        self._batch.endpoints.add((namespace, service or f"?{source}"))
        if service:
            self._arrived((namespace, service))

    @property
    def pending_services(self) -> int:
        return len(self._batch.services)

    @property
    def pending_endpoints(self) -> int:
        return len(self._batch.endpoints)

    def checkout(self) -> ChangeBatch:
        batch, self._batch = self._batch, ChangeBatch()
        return batch

    def restore(self, batch: ChangeBatch) -> None:
        """A sync failed: its changes are pending again (with their first arrival)."""
        batch.merge(self._batch)
        self._batch = batch
