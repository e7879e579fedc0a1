"""The agent's Prometheus metrics, on a private registry.

Names follow kube-proxy's (`pkg/proxy/metrics/metrics.go`) where one exists, so
dashboards and alerts written for kube-proxy keep working; what only sliceproxy knows
(skipped objects, endpoint conflicts, the watch layer) is under `sliceproxy_*`.
Values that already live elsewhere (the model's skip records, the reflectors' counters)
are read at scrape time by collectors instead of being counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import fields

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.dataplane import modes
from proxy.kube.reflector import Reflector, ReflectorStats
from proxy.model.tracker import ClusterModel
from proxy.server.traffic import TrafficReading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Upstream: ExponentialBuckets(0.001, 2, 15), 1 ms to 16 s.
SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
# Upstream's programming-latency buckets start at 250 ms; ours add finer ones below,
# since a node applies a change in milliseconds when nothing holds it back.
PROGRAMMING_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1,
    *(0.25 * i for i in range(1, 4)),
    *(float(i) for i in range(1, 60)),
    *(60.0 + 5 * i for i in range(12)),
    *(120.0 + 30 * i for i in range(7)),
)


CLEARED_HELP = "Stale UDP/SCTP conntrack entries deleted (after syncs and by the reconcile)"
FLOWS_RESET_HELP = ("TCP flows to endpoints that left their service, reset (--fail-fast, "
                    "the sliceproxy.io/fail-fast annotation)")
DELETED_HELP = ("Stale UDP/SCTP conntrack entries deleted, by reason: endpoint-gone and "
                "first-endpoint after a change, stale-dnat and missing-dnat by the reconcile")
SYNC_CPU_HELP = ("CPU seconds syncs used: resolve, render and apply on the agent's "
                 "threads, and the tools they ran (what --sync-cpu-budget limits)")
HELD_HELP = ("Syncs started later than the change that asked for them, by the limit that "
             "held them back: cpu-budget (--sync-cpu-budget) or min-sync-period")

FOREIGN_ACTIVE_HELP = ("1 while another service proxy is programming this node: its rules "
                       "were written within the last window (docs/monitoring.md), by proxy")
FOREIGN_DETECTIONS_HELP = ("Checks that found another service proxy's rules written on this "
                           "node since the check before, by proxy")


class AgentMetrics:
    def __init__(self) -> None:
        # kube-proxy exports no *_created series; they would only double the output.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        self._traffic: TrafficReading | None = None  # watch_traffic
        # Each metric below: its attribute, name and help, in the order of the output.
        self._kube_proxy_syncs()
        self._kube_proxy_events_and_health()
        self._syncs()
        self._node()

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...] = SYNC_BUCKETS,
                   ) -> Histogram:
        return Histogram(name, doc, buckets=buckets, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _kube_proxy_syncs(self) -> None:
        """kube-proxy's sync histograms and timestamps, under its names."""
        histogram, gauge = self._histogram, self._gauge
        self.sync_duration = histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds (resolve + render + apply)")
        self.sync_full_duration = histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "Latency of full syncs in seconds")
        self.sync_partial_duration = histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "Latency of partial syncs in seconds")
        self.network_programming = histogram(
            "kubeproxy_network_programming_duration_seconds",
            "Time from a change's arrival at the agent to its rules being applied",
            PROGRAMMING_BUCKETS)
        self.last_sync = gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced")
        self.last_queued = gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued")

    def _kube_proxy_events_and_health(self) -> None:
        """kube-proxy's change counters and gauges, the mode counters, health answers."""
        gauge, counter = self._gauge, self._counter
        self.endpoint_changes_pending = gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Services with endpoint changes not yet synced")
        self.service_changes_pending = gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Services with changes not yet synced")
        self.endpoint_changes = counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Endpoint (EndpointSlice or Endpoints) events received")
        self.service_changes = counter(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Service events received")
        # Those only one mode has, as modes.py declares them (count_mode).
        self.mode_counters = {c.name: counter(c.name, c.help)
                              for mode in modes.MODES for c in mode.counters}
        self.healthz = counter(
            "kubeproxy_proxy_healthz",
            "/healthz answers by HTTP code", ("code",))
        self.livez = counter(
            "kubeproxy_proxy_livez",
            "/livez answers by HTTP code", ("code",))

    def _syncs(self) -> None:
        """What only sliceproxy counts about its syncs and conntrack clean-up."""
        counter = self._counter
        self.syncs = counter(
            "sliceproxy_syncs",
            "Syncs by kind (full, partial) and result (ok, error)", ("kind", "result"))
        self.apply_failures = counter(
            "sliceproxy_sync_apply_failures",
            "Syncs whose apply the kernel refused, by proxy mode", ("mode",))
        self.sync_cpu = counter("sliceproxy_sync_cpu_seconds", SYNC_CPU_HELP)
        self.syncs_held = counter("sliceproxy_syncs_held_back", HELD_HELP, ("reason",))
        for reason in ("cpu-budget", "min-sync-period"):  # exported at 0 from the start
            self.syncs_held.labels(reason)
        self.conntrack_cleared = counter("sliceproxy_conntrack_entries_cleared", CLEARED_HELP)
        self.conntrack_deleted = counter("sliceproxy_conntrack_entries_deleted", DELETED_HELP,
                                         ("reason",))
        self.tcp_flows_reset = counter("sliceproxy_tcp_flows_reset", FLOWS_RESET_HELP)

    def _node(self) -> None:
        """Drift of our rules, other proxies on the node, the first sync."""
        gauge, counter = self._gauge, self._counter
        self.drift_checks = counter(
            "sliceproxy_rules_drift_checks",
            "Checks of our rules after another process changed the tables they live in")
        self.drift_repairs = counter(
            "sliceproxy_rules_drift_repairs",
            "Full syncs run because another process had changed or removed our rules")
        # Their series start at 0 when the agent's check starts (agent/foreign_proxy.py).
        self.foreign_proxy_active = gauge(
            "sliceproxy_foreign_proxy_active", FOREIGN_ACTIVE_HELP, ("proxy",))
        self.foreign_proxy_detections = counter(
            "sliceproxy_foreign_proxy_detections", FOREIGN_DETECTIONS_HELP, ("proxy",))
        self.foreign_proxy_checks = counter(
            "sliceproxy_foreign_proxy_checks",
            "Checks for another service proxy's rules on this node (the first one included)")
        self.first_sync = gauge(
            "sliceproxy_first_sync_seconds",
            "Seconds from process start to the first successful sync")

    def count_conntrack(self, deleted: Mapping[str, int]) -> None:
        """Conntrack entries a sync or a reconcile deleted, by reason."""
        for reason, count in deleted.items():
            if count:
                self.conntrack_deleted.labels(reason).inc(count)
                self.conntrack_cleared.inc(count)

    def count_mode(self, counted: Mapping[str, int]) -> None:
        """What a sync or a failed one adds to its mode's own counters, by name (a data
        plane takes the names from modes.py, where every one is declared)."""
        for name, count in counted.items():
            self.mode_counters[name].inc(count)

    def watch_model(self, model: Callable[[], ClusterModel | None]) -> None:
        self.registry.register(ModelCollector(model))

    def watch_reflectors(self, reflectors: Callable[[], Iterable[Reflector]]) -> None:
        self.registry.register(WatchCollector(reflectors))

    def watch_traffic(self, reading: TrafficReading) -> None:
        """Each service port's (and counted endpoint's) traffic, from the last reading
        (server/traffic.py), which the scrape refreshes first."""
        self._traffic = reading

    def render(self) -> bytes:
        return b"".join(self.render_parts())

    def render_parts(self) -> tuple[bytes, ...]:
        """The scrape's text in parts, written one after the other: not joined into
        one, which at 100,000 ports copied 10 MB on the event loop at every scrape."""
        text = generate_latest(self.registry)
        return (text, *self._traffic.series()) if self._traffic is not None else (text,)


class ModelCollector(Collector):
    """Skipped objects by kind and reason, endpoint conflicts, service ports: read from
    the model at scrape time (the model lives on the event loop, as do scrapes)."""

    def __init__(self, model: Callable[[], ClusterModel | None]) -> None:
        self._model = model

    def collect(self) -> Iterator[Metric]:
        skipped = GaugeMetricFamily(
            "sliceproxy_skipped_objects",
            "Objects (or parts of objects) skipped as invalid or not ours, by reason",
            labels=["kind", "reason"])
        conflicts = GaugeMetricFamily(
            "sliceproxy_endpoint_conflicts",
            "Endpoints listed by several slices whose copies disagree")
        ports = GaugeMetricFamily(
            "sliceproxy_service_ports", "Service ports (per IP family) this node proxies")
        model = self._model()
        if model is not None:
            # Counts, not records: the model keeps a few records per object only.
            for (kind, reason), count in sorted(model.skip_counts().items()):
                skipped.add_metric([kind, reason], count)
            state = model.state
            conflicts.add_metric([], state.conflicts)
            ports.add_metric([], len(state))
        yield from (skipped, conflicts, ports)


_WATCH_HELP = {
    "lists": "Completed lists (the first included)",
    "relists": "Lists after the first: 410 Gone (history expired), or a server whose "
               "revision went below ours",
    "expired": "410 Gone answers (watch history, or a list's continue token)",
    "watches": "Watch streams opened",
    "watch_restarts": "Watch streams the server ended (timeoutSeconds), reopened",
    "short_watches": "Watch streams that ended at once with nothing delivered (backed off)",
    "stalls": "Watch streams restarted after going silent",
    "probes": "One-item lists after silent streams, checking the server's revision",
    "errors": "Failed list or watch requests (retried with backoff)",
    "events": "Watch and list events delivered",
    "bookmarks": "Bookmarks received",
    "oversized": "Watch events skipped for exceeding the size limit",
    "went_back": "resourceVersions below ours (events, bookmarks or a list): relisted",
    "overdue": "Watch streams we ended: the server kept them open past timeoutSeconds",
    "bad_lists": "Lists given up: too large, too many pages or items, or repeating",
    "unkeyed": "Objects without a usable namespace and name, passed on to be skipped",
}
# Every integer counter of ReflectorStats is exported, including ones added later.
_WATCH_COUNTERS = [f.name for f in fields(ReflectorStats) if f.type in (int, "int")]


class WatchCollector(Collector):
    def __init__(self, reflectors: Callable[[], Iterable[Reflector]]) -> None:
        self._reflectors = reflectors

    def collect(self) -> Iterator[Metric]:
        families = {
            name: CounterMetricFamily(
                f"sliceproxy_watch_{name}",
                _WATCH_HELP.get(name, f"Watch layer counter {name!r} (ReflectorStats)"),
                labels=["resource"])
            for name in _WATCH_COUNTERS
        }
        for reflector in self._reflectors():
            for name in _WATCH_COUNTERS:
                families[name].add_metric([str(reflector.resource)],
                                          getattr(reflector.stats, name))
        yield from families.values()
