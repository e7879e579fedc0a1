"""Another service proxy programming this node: kube-proxy brought back by kubeadm (its
add-on phase, re-run by `kubeadm upgrade apply`), both proxies then writing rules for
every Service. Said loudly, so an operator sees it before users do: an error line (again
every REPEAT while it lasts, and an info line when it ends), the
`sliceproxy_foreign_proxy_active` gauge and detections counter, and `foreignProxies`
in /healthz's body (its code unchanged: proxy/server/health.py says why).

Every --foreign-proxy-check-interval (10 s) a thread of its own reads kube-proxy's
objects (proxy/dataplane/common/foreign_proxy.py) and compares them with the last check
(kube_proxy_objects.writes): only objects being *written* count, never leftovers nobody
writes any more (normal during a migration, until kube-proxy's cleanup runs). The first
check is the baseline: a kube-proxy already running when the agent starts is seen at
its next write (at a change of a Service or endpoint, or its hourly resync).

A proxy stays "active" until WINDOW has passed since its last write seen, or at once
when every object of it is gone (removed by its cleanup). WINDOW is just over an hour
because a running kube-proxy may write that seldom: in iptables and nftables modes it
writes at start, at each change and at an hourly resync (upstream's
BoundedFrequencyRunner maxInterval, time.Hour), so a quiet cluster's kube-proxy shows
itself once an hour.

The checks run on their own thread, not the data plane's: a sync of 10,000 services
never waits for one, and one never waits for a sync.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from proxy.agent.worker import Worker
from proxy.dataplane.common.foreign_proxy import KubeProxyReader, Reading
from proxy.dataplane.common.kube_proxy_objects import PROXY, Place, writes
from proxy.server.health import ForeignProxy, ProxyHealth
from proxy.server.metrics import AgentMetrics

log = logging.getLogger(__name__)

WINDOW = 3900.0  # 65 min: kube-proxy's hourly resync and some slack (module docstring)
REPEAT = 300.0  # the error line again every 5 minutes while it lasts
SHOWN = 8  # objects named in a log line and in /healthz
FIX = ("keep one service proxy per node: stop the other (kubeadm's kube-proxy add-on: "
       "docs/migrate.md), then remove its rules (deploy/migrate/kube-proxy-cleanup.yaml)")


@dataclass(slots=True)
class _Episode:
    since: float  # monotonic
    since_wall: float
    last_write: float
    last_write_wall: float
    logged: float
    places: set[Place] = field(default_factory=set)  # written during this episode

    def objects(self) -> tuple[str, ...]:
        return tuple(str(p) for p in sorted(self.places))[:SHOWN]

    def backends(self) -> tuple[str, ...]:
        return _backends(self.places)


@dataclass(frozen=True, slots=True)
class Event:
    """What the agent says after a check (pure: ForeignProxyState.observe's answer)."""

    kind: str  # "started", "continues", "ended"
    proxy: str
    objects: tuple[str, ...]
    backends: tuple[str, ...]  # "iptables-nft IPv4", ...
    seconds: float  # since it started (0 when it starts)
    why: str = ""  # for "ended": "removed" or "no write for ..."


class ForeignProxyState:
    """Which other proxies are programming the node, from each check's writes and what
    exists; what to log and when (pure, on a given clock)."""

    def __init__(self, window: float = WINDOW, repeat: float = REPEAT) -> None:
        self.window, self.repeat = window, repeat
        self.active: dict[str, _Episode] = {}

    def observe(self, now: float, wall: float, written: Iterable[Place],
                present: Iterable[Place]) -> list[Event]:
        by_proxy: dict[str, list[Place]] = {}
        for place in written:
            by_proxy.setdefault(place.proxy, []).append(place)
        there = {place.proxy for place in present}
        events = []
        for proxy, places in sorted(by_proxy.items()):
            episode = self.active.get(proxy)
            if episode is None:
                episode = self.active[proxy] = _Episode(now, wall, now, wall, now,
                                                        set(places))
                events.append(Event("started", proxy, episode.objects(),
                                    episode.backends(), 0.0))
                continue
            episode.last_write, episode.last_write_wall = now, wall
            episode.places.update(places)
        for proxy, episode in sorted(self.active.items()):
            if proxy not in there:
                why = "its objects were removed"
            elif now - episode.last_write > self.window:
                why = f"no write seen for {self.window:g}s"
            else:
                if now - episode.logged >= self.repeat:
                    episode.logged = now
                    events.append(Event("continues", proxy, episode.objects(),
                                        episode.backends(), now - episode.since))
                continue
            del self.active[proxy]
            events.append(Event("ended", proxy, episode.objects(), episode.backends(),
                                now - episode.since, why))
        return events

    def shown(self) -> tuple[ForeignProxy, ...]:
        """For /healthz."""
        return tuple(ForeignProxy(proxy, e.since_wall, e.last_write_wall, e.objects())
                     for proxy, e in sorted(self.active.items()))


def _backends(places: Iterable[Place]) -> tuple[str, ...]:
    """Where they are: "iptables-nft IPv4", "nftables IPv6", "ipvs"."""
    return tuple(sorted({f"{p.backend} {p.family}".strip() for p in places}))


class ForeignProxyCheck:
    """The periodic check: its own thread reads, the event loop reports."""

    def __init__(self, interval: float, metrics: AgentMetrics, health: ProxyHealth, *,
                 reader: Callable[[], KubeProxyReader] = KubeProxyReader,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.interval = interval
        self.metrics, self.health = metrics, health
        self._reader_factory, self._clock, self._wall = reader, clock, wall
        self.state = ForeignProxyState()
        self._errors: dict[str, str] = {}

    async def run(self) -> None:
        """Check every `interval` until cancelled."""
        self.metrics.foreign_proxy_active.labels(PROXY).set(0)
        self.metrics.foreign_proxy_detections.labels(PROXY)
        worker = Worker("foreign-proxy")
        reader = await worker.call(self._reader_factory)
        last: Reading | None = None  # None: the next reading is the baseline
        try:
            while True:
                try:
                    now = await worker.call(reader.read)
                except Exception:  # a bug: never fatal, the next check tries again
                    log.exception("checking for another service proxy failed")
                    now = None
                if now is not None:
                    self.metrics.foreign_proxy_checks.inc()
                    self._note_errors(reader.errors)
                    if last is not None:  # the baseline: leftovers raise nothing
                        self._report(writes(last, now), now)
                    last = now
                await asyncio.sleep(self.interval)
        finally:
            worker.call(reader.close)
            worker.stop(timeout=0)

    def _report(self, written: list[Place], present: Iterable[Place]) -> None:
        for proxy in {p.proxy for p in written}:
            self.metrics.foreign_proxy_detections.labels(proxy).inc()
        for event in self.state.observe(self._clock(), self._wall(), written, present):
            extra = {"proxy": event.proxy, "objects": ", ".join(event.objects),
                     "backends": ", ".join(event.backends)}
            if event.kind == "ended":
                self.metrics.foreign_proxy_active.labels(event.proxy).set(0)
                log.info("another service proxy stopped programming this node",
                         extra={**extra, "why": event.why,
                                "lasted": f"{event.seconds:.0f}s"})
                continue
            self.metrics.foreign_proxy_active.labels(event.proxy).set(1)
            log.error("another service proxy is programming this node", extra={
                **extra, "since": f"{event.seconds:.0f}s", "fix": FIX})
        self.health.foreign_proxies = self.state.shown()

    def _note_errors(self, errors: dict[str, str]) -> None:
        """A part that cannot be read: a warning when it starts failing, once."""
        for part, error in errors.items():
            if part not in self._errors:
                log.warning("cannot check for another service proxy's rules",
                            extra={"part": part, "error": error})
        self._errors = dict(errors)
