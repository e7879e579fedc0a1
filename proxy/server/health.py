"""The proxy's health, as kube-proxy's `/healthz` and `/livez` define it.

Upstream (`pkg/proxy/healthcheck/proxy_health.go`): a change that arrives is "queued";
a successful sync marks the proxy "updated" and clears the queue. The proxy is
unhealthy while the oldest queued change has waited `threshold` or longer. `/healthz`
also requires the node to be eligible (not being deleted, not tainted
`ToBeDeletedByClusterAutoscaler`), so load balancers drain a node on its way out;
`/livez` ignores the node.

One difference, on purpose: upstream's `/healthz` answers 200 before the first sync
(nothing is queued yet). Ours answers 503 until the first full sync has programmed the
rules, so a readiness probe and a cloud load balancer's check both wait for rules that
really exist. `/livez` stays 200 during start-up, as upstream, so a slow or unreachable
API server never gets the agent restarted in a loop.

Another service proxy writing its rules on the node (agent/foreign_proxy.py) is shown
in `/healthz`'s body (`foreignProxies`) but changes neither answer's code: the node's
Services still work (both proxies send a connection to a live endpoint), whereas a 503
would take every such node out of the load balancers that check /healthz at once (an
upgrade brings kube-proxy back on all of them together), and a failing /livez would get
the agent restarted in a loop, which removes nothing. The log line, the metric and its
alert are what call an operator.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"


def go_time(epoch: float | None) -> str:
    """A wall-clock time as Go prints a UTC time.Time (what upstream's JSON carries)."""
    if epoch is None:
        return "0001-01-01 00:00:00 +0000 UTC"
    dt = datetime.fromtimestamp(epoch, UTC)
    frac = f"{dt.microsecond:06d}".rstrip("0")
    return dt.strftime("%Y-%m-%d %H:%M:%S") + (f".{frac}" if frac else "") + " +0000 UTC"


def node_eligible(node: object) -> bool:
    """False for a Node being deleted or tainted for deletion by the autoscaler.

    The object is as the server sent it, before any decoding: a field of the wrong type
    (metadata [], taints "x") is read as absent, never raised on (the decoder records
    the object as skipped)."""
    if not isinstance(node, dict):
        return True
    meta, spec = node.get("metadata"), node.get("spec")
    if isinstance(meta, dict) and meta.get("deletionTimestamp"):
        return False
    taints = spec.get("taints") if isinstance(spec, dict) else None
    return not (isinstance(taints, list) and any(
        isinstance(t, dict) and t.get("key") == TO_BE_DELETED_TAINT for t in taints))


@dataclass(frozen=True, slots=True)
class ForeignProxy:
    """Another service proxy seen writing its rules on this node, as /healthz shows it."""

    name: str  # "kube-proxy"
    since: float  # wall clock: its first write seen, this time
    last_write: float  # wall clock: its last write seen
    objects: tuple[str, ...]  # what it wrote (the first few)


@dataclass(frozen=True, slots=True)
class HealthStatus:
    healthy: bool  # the /livez answer (sync keeps up)
    ready: bool  # the /healthz answer (also: first sync done, node eligible)
    last_updated: float | None  # wall clock of the last successful sync
    current_time: float
    node_eligible: bool
    first_sync_done: bool
    oldest_queued_age: float | None  # seconds the oldest unapplied change has waited


class ProxyHealth:
    def __init__(self, threshold: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.threshold = threshold
        self._clock, self._wall = clock, wall
        self._oldest_queued: float | None = None
        self._in_flight: float | None = None
        self._last_updated: float | None = None
        self.node_eligible = True
        self.first_sync_done = False
        self.foreign_proxies: tuple[ForeignProxy, ...] = ()  # set by the agent's check

    def queued(self) -> None:
        """A change arrived that the rules do not reflect yet."""
        if self._oldest_queued is None:
            self._oldest_queued = self._clock()

    def sync_started(self) -> None:
        """A sync took the queued changes: they count as waiting until it succeeds."""
        if self._oldest_queued is not None and (
                self._in_flight is None or self._oldest_queued < self._in_flight):
            self._in_flight = self._oldest_queued
        self._oldest_queued = None

    def sync_failed(self) -> None:
        """The changes the failed sync took are still waiting; the retry takes them."""
        if self._in_flight is not None:
            self.requeue(self._in_flight)
        self._in_flight = None

    def updated(self) -> None:
        """A sync succeeded: what it took is applied (changes that arrived while it ran
        stay queued for the next one; upstream drops those too early)."""
        self._in_flight = None
        self._last_updated = self._wall()
        self.first_sync_done = True

    def requeue(self, since: float) -> None:
        if self._oldest_queued is None or since < self._oldest_queued:
            self._oldest_queued = since

    @property
    def oldest_waiting(self) -> float | None:
        """Arrival time of the oldest change not yet applied (queued or in a sync)."""
        times = [t for t in (self._oldest_queued, self._in_flight) if t is not None]
        return min(times) if times else None

    def status(self) -> HealthStatus:
        now = self._clock()
        oldest = self.oldest_waiting
        age = None if oldest is None else now - oldest
        healthy = age is None or age < self.threshold
        return HealthStatus(
            healthy=healthy,
            ready=healthy and self.first_sync_done and self.node_eligible,
            last_updated=self._last_updated,
            current_time=self._wall(),
            node_eligible=self.node_eligible,
            first_sync_done=self.first_sync_done,
            oldest_queued_age=age,
        )
