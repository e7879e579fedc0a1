"""The agent: watch -> model -> sync runner -> data plane, plus its HTTP faces.

Start-up order matters:
1. the health and metrics servers start first, so probes get an answer (/livez 200,
   /healthz 503 until the first sync) while the rest comes up;
2. the API client loads its configuration (a bad kubeconfig stops us here);
3. the data plane is built on its worker thread; it must not touch existing rules:
   a restarted agent leaves the previous run's rules serving traffic; then the client
   discovers which EndpointSlice version the server has;
4. the watches list everything; only when every resource has listed does the first
   (full) sync replace the old rules in one step, so no sync ever programs a partial
   view of the cluster; once it is in the kernel, the other proxy modes' leftovers are
   removed (proxy/dataplane/leftovers.py; never this mode's own rules): a mode switch
   has a moment with both modes' rules, never one with neither (_remove_leftovers);
5. from then on each change requests a sync, which runs as soon as the previous one
   has ended, within --sync-cpu-budget (and --min-sync-period, if set: schedule.py).
On SIGTERM/SIGINT everything stops within seconds and the rules stay in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from proxy.agent.changes import ChangeLog
from proxy.agent.foreign_proxy import ForeignProxyCheck
from proxy.agent.logs import V
from proxy.agent.nodeport_warnings import PrimaryAddressWarnings
from proxy.agent.sync_loop import SyncLoop
from proxy.agent.worker import Worker
from proxy.config.options import Config, format_cpu_budget, format_duration
from proxy.dataplane.base import (
    DataPlane,
    DataplaneOptions,
    PortTraffic,
    TrafficRead,
    offer_lock,
)
from proxy.dataplane.common.heap import release_free_memory
from proxy.dataplane.common.priority import Priority
from proxy.dataplane.factory import make_dataplane
from proxy.kube.backoff import Backoff
from proxy.kube.client import Api, ClientOptions, KubeApi
from proxy.kube.cluster_watch import ClusterWatch, endpoint_slice_resource
from proxy.kube.ingest import EndpointsSource, apply_object, delete_object
from proxy.kube.reflector import ReflectorOptions, WatchEvent
from proxy.kube.resources import ENDPOINTS, Resource
from proxy.model.snapshot import DesiredState
from proxy.model.tracker import ClusterModel
from proxy.model.types import LABEL_SERVICE_NAME, Balancing, IPAddress, ServicePortKey
from proxy.server.dump import build_dump, selected_keys
from proxy.server.health import ProxyHealth, node_eligible
from proxy.server.http import health_app, metrics_app, serve
from proxy.server.metrics import AgentMetrics
from proxy.server.nodeports import HealthCheckPorts, LocalEndpointTracker
from proxy.server.traffic import TrafficReading

log = logging.getLogger(__name__)
_EVENT_LEVEL = V(4)  # each event received

DUMP_RULES_TIMEOUT = 2.0  # a dump never waits longer than this for a busy data plane
# Service ports resolved ahead at a time while endpoints list (a few ms): the list's
# reader runs in between, so the API server is never kept waiting long.
RESOLVE_AHEAD_BATCH = 64
CLOSE_TIMEOUT = 3.0


class StartupError(Exception):
    """The agent cannot start (bad kubeconfig, port in use, data plane unavailable)."""


def process_age() -> float:
    """Seconds since this process started (so start-up time includes interpreter and
    imports), from /proc; 0 where that is not available."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 (starttime), counted after "pid (comm)"
        boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return max(0.0, boot - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def health_threshold(config: Config) -> float:
    """How long a change may wait before /healthz fails. Upstream uses 2x its 30s
    --sync-period (60s); our --sync-period is the hourly full resync, so the default is
    60s, stretched when a --min-sync-period set that long would make changes wait longer.
    The CPU budget does not stretch it: a change held back by it for a minute means syncs
    cost more than the budget allows, which /healthz should report."""
    if config.healthz_threshold:
        return config.healthz_threshold
    return max(60.0, 3 * (config.min_sync_period or 0.0))


def dataplane_options(config: Config) -> DataplaneOptions:
    return DataplaneOptions(
        node_name=config.node_name,
        cluster_cidrs=config.cluster_cidr,
        masquerade_all=config.masquerade_all,
        nodeport_addresses=config.nodeport_addresses,
        nodeport_primary=config.nodeport_primary,
        ipvs_scheduler=config.ipvs_scheduler,
        iptables_applier=config.iptables_applier,
        fail_fast=config.fail_fast,
        traffic_per_endpoint=config.traffic_per_endpoint,
    )


class Agent:
    def __init__(
        self,
        config: Config,
        *,
        dataplane_factory: Callable[[], DataPlane] | None = None,
        api_factory: Callable[[], Any] | None = None,
        reflector_options: ReflectorOptions | None = None,
        started_at: float | None = None,
        clean_leftovers: bool | None = None,
        check_foreign_proxy: bool | None = None,
    ) -> None:
        self.config = config
        # Remove the other proxy modes' leftovers after the first sync: by default
        # when the agent builds its own data plane (not a test's stand-in).
        self._clean_leftovers = (dataplane_factory is None if clean_leftovers is None
                                 else clean_leftovers)
        # Look for another service proxy on the node (agent/foreign_proxy.py): likewise.
        self._check_foreign = (dataplane_factory is None if check_foreign_proxy is None
                               else check_foreign_proxy)
        self._dataplane_factory = dataplane_factory or (
            lambda: make_dataplane(config.proxy_mode, dataplane_options(config)))
        self._api_factory = api_factory
        self._reflector_options = reflector_options
        self.clock = time.monotonic
        self.started_at = self.clock() - process_age() if started_at is None else started_at
        self.metrics = AgentMetrics()
        self.health = ProxyHealth(health_threshold(config))
        self.model = ClusterModel(config.node_name, config.service_proxy_name,
                                  Balancing(config.default_balancing))
        self.changes = ChangeLog(self.clock)
        self.worker = Worker()
        self.dataplane: DataPlane | None = None
        self.api: Api | None = None
        self.watch: ClusterWatch | None = None
        self.runner: SyncLoop | None = None
        self.endpoints_resource: Resource | None = None
        self.hc_ports = HealthCheckPorts(lambda: self.health.status().healthy,
                                         config.nodeport_addresses, config.nodeport_primary)
        self._hc_primary: tuple[IPAddress, ...] = ()  # what hc_ports last listened by
        self._primary_warnings = PrimaryAddressWarnings(config)
        self._local = LocalEndpointTracker(config.node_name)
        self.first_synced = asyncio.Event()  # set once the first sync is in the kernel
        # Set once the data plane's work left for after it is done too (SyncLoop.on_settled).
        self.settled = asyncio.Event()
        self._arrived = asyncio.Event()  # an object arrived (resolving ahead waits on it)
        self._http: list[web.AppRunner] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.metrics.watch_model(lambda: self.model)
        self.metrics.watch_reflectors(
            lambda: self.watch.reflectors if self.watch is not None else ())
        self.traffic = TrafficReading()
        self.metrics.watch_traffic(self.traffic)

    # --- lifecycle -------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set. Raises StartupError if it cannot start."""
        try:
            await self._start_http()
            # The API client only loads its configuration here (no request yet): a bad
            # kubeconfig fails before anything touches the kernel.
            await self._connect()
            await self._start_dataplane()
            if self._check_foreign and self.config.foreign_proxy_check_interval > 0:
                check = ForeignProxyCheck(self.config.foreign_proxy_check_interval,
                                          self.metrics, self.health)
                self._spawn(check.run(), "foreign proxy check")
            if stop.is_set():
                return
            await self._discover(stop)
            if stop.is_set():
                return
            self._start_watch()
            await self._first_sync(stop)
            await stop.wait()
        finally:
            await self.shutdown()

    async def _start_http(self) -> None:
        cfg = self.config
        dump = metrics_app(self.metrics, None if cfg.debug_dump == "false" else self,
                           loopback_only=cfg.debug_dump == "local",
                           refresh=self.refresh_traffic)
        for (host, port), app, what in (
            (cfg.healthz_bind_address, health_app(self.health, self.metrics), "healthz"),
            (cfg.metrics_bind_address, dump, "metrics"),
        ):
            if port == 0:
                log.info("%s server disabled (port 0)", what)
                continue
            try:
                runner, listening = await serve(app, host, port)
            except OSError as exc:
                raise StartupError(f"--{what}-bind-address {host}:{port}: cannot listen: "
                                   f"{exc.strerror or exc}") from exc
            self._http.append(runner)
            if listening.ipv6_missing is not None:
                log.info("IPv6 is not available here: serving %s on IPv4 only", what,
                         extra={"address": listening.address,
                                "reason": listening.ipv6_missing})
            extra = {"address": listening.address, "families": listening.families}
            if what == "metrics":
                extra["debug_dump"] = cfg.debug_dump
            log.info("serving %s", what, extra=extra)

    async def _start_dataplane(self) -> None:
        try:
            self.dataplane = await self.worker.call(self._dataplane_factory)
        except Exception as exc:
            raise StartupError(f"cannot start the {self.config.proxy_mode} data plane: "
                               f"{exc}") from exc
        log.info("data plane ready; existing rules are kept until the first full sync",
                 extra={"mode": self.dataplane.mode})

    async def _connect(self) -> None:
        if self._api_factory is not None:
            self.api = self._api_factory()
            return
        from proxy.kube.client import ConfigError

        try:
            self.api = await KubeApi.connect(
                ClientOptions(kubeconfig=self.config.kubeconfig, master=self.config.master))
        except ConfigError as exc:
            raise StartupError(str(exc)) from exc

    async def _discover(self, stop: asyncio.Event) -> None:
        """Which endpoints resource to watch; retried while the API server is away."""
        assert self.api is not None
        if self.config.endpoints_source is EndpointsSource.ENDPOINTS:
            self.endpoints_resource = ENDPOINTS
            log.info("using legacy Endpoints (core/v1), as --endpoints-source=endpoints asks")
            return
        # The reflectors' cap, not client-go's 30 s: an agent started while the API server
        # is away must not wait longer for its return than a running one does.
        options = self._reflector_options or ReflectorOptions()
        backoff = Backoff(options.backoff_initial, options.backoff_max)
        while not stop.is_set():
            try:
                self.endpoints_resource = await endpoint_slice_resource(self.api)
                break
            except Exception as exc:
                delay = backoff.next()
                log.warning("EndpointSlice API discovery failed; retrying",
                            extra={"api_server": self.api.host, "error": str(exc),
                                   "retry_in": round(delay, 2)})
                await _wait(stop, delay)
        if self.endpoints_resource is not None:
            log.info("using EndpointSlice API %s", self.endpoints_resource.group_version,
                     extra={"resource": str(self.endpoints_resource)})

    def _start_watch(self) -> None:
        assert self.api is not None and self.endpoints_resource is not None
        assert self.dataplane is not None
        self.runner = SyncLoop(
            self.model, self.dataplane, self.worker,
            min_sync_period=self.config.min_sync_period,
            sync_period=self.config.sync_period,
            cpu_budget=self.config.sync_cpu_budget,
            metrics=self.metrics, health=self.health, changes=self.changes,
            clock=self.clock, started_at=self.started_at, on_synced=self._synced,
            on_settled=self.settled.set)
        kwargs: dict[str, Any] = {"slice_resource": self.endpoints_resource}
        if self._reflector_options is not None:
            kwargs["options"] = self._reflector_options
        self.watch = ClusterWatch(self.api, self.config.node_name,
                                  self.config.endpoints_source, self._on_event, **kwargs)
        self.watch.start()
        self._spawn(self.runner.run(), "sync runner")
        log.info("agent started", extra={
            "node": self.config.node_name, "mode": self.config.proxy_mode,
            "endpoints_source": self.config.endpoints_source.value,
            "min_sync_period": (format_duration(self.config.min_sync_period)
                                if self.config.min_sync_period is not None else "unset"),
            "sync_cpu_budget": format_cpu_budget(self.config.sync_cpu_budget),
            "sync_period": format_duration(self.config.sync_period),
            "healthz_threshold": format_duration(self.health.threshold)})

    async def _first_sync(self, stop: asyncio.Event) -> None:
        assert self.watch is not None and self.runner is not None
        synced = asyncio.ensure_future(self.watch.wait_synced())
        stopped = asyncio.ensure_future(stop.wait())
        ahead = asyncio.ensure_future(self._resolve_ahead())
        try:
            await asyncio.wait({synced, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for fut in (synced, stopped, ahead):
                fut.cancel()
        if stop.is_set():
            return
        # The lists' parsed bodies are gone; hand their pages back before the first
        # sync's own peak (heap.py).
        release_free_memory()
        log.info("every watched resource has listed; running the first full sync",
                 extra={"service_ports_dirty": len(self.model.dirty),
                        "resolved_ahead": self.model.resolved_ahead,
                        "since_start": f"{self.clock() - self.started_at:.3f}s"})
        self.runner.start()
        if not await _either(self.first_synced, stop):
            return
        if self._clean_leftovers:
            await self._remove_leftovers()
        await self._watch_drift()

    async def _resolve_ahead(self) -> None:
        """Once Services and the Node have listed, resolve and render the service
        ports whose endpoints have arrived while the rest still list
        (ClusterModel.resolve_ahead, DataPlane.render_ahead): at 10,000 services the API
        server takes seconds to send them, time the agent otherwise spent waiting.
        Cancelled when everything has listed."""
        assert self.watch is not None and self.dataplane is not None
        await self.watch.wait_synced_but_endpoints()
        dataplane, expected = self.dataplane, self.model.port_counts()
        primary = self.model.primary_ips  # the Node has listed
        try:
            while True:
                if ports := self.model.resolve_ahead(RESOLVE_AHEAD_BATCH):
                    # Rendered ahead too, on the data plane's thread; the lists' readers
                    # run meanwhile.
                    await self.worker.call(
                        lambda: dataplane.render_ahead(ports, expected, primary))
                else:
                    self._arrived.clear()
                    await self._arrived.wait()
        except Exception:  # a bug: the first sync still resolves and renders the rest
            log.exception("resolving ahead failed; the first sync does it all")

    async def _remove_leftovers(self) -> None:
        """Remove the other proxy modes' rules (proxy/dataplane/leftovers.py), on the data
        plane's thread, in its namespace. Here, once the first sync is in the kernel,
        rather than at start as upstream does: until then the old mode's rules serve
        (an agent started while the API server is away changes nothing), and removed
        before it, they left a moment with no rules at all, in which a new connection to
        a service address was routed as an unknown destination ("Network is unreachable":
        one per node at every switch, on real nodes). For that moment both modes' rules
        are in place, and each is whole; a new connection takes the first that captures
        it, so it is served either way (docs/upgrade.md, "Switching the mode"):
        - iptables and nftables: the kernel runs every nat chain at a hook in priority
          order until one makes a NAT binding (nf_nat_inet_fn); either mode's DNAT is a
          complete answer, and the other's filter rules see the endpoint's address, not
          the service's, so they do not interfere;
        - IPVS and either: the other mode's DNAT at prerouting/output comes before the
          routing that delivers a service address to IPVS on the dummy interface, so
          the DNAT mode serves new connections; IPVS's own nat chains only set the
          masquerade mark and return, so the packet goes on to the next nat rule.
        Established connections keep the NAT binding conntrack holds for them; those
        made through IPVS end when leaving IPVS mode removes the dummy interface.
        Never fatal; our own mode's rules are never touched."""
        from proxy.dataplane import leftovers

        mode, options = self.config.proxy_mode, dataplane_options(self.config)
        try:
            await self.worker.call(lambda: leftovers.clean(mode, options))
        except Exception as exc:  # clean() logs its own failures; this is a bug's net
            log.warning("removing other proxy modes' leftovers failed: %s", exc,
                        extra={"mode": mode, "error": str(exc)})

    async def _watch_drift(self) -> None:
        """Let the data plane tell the runner when another process changed our rules."""
        assert self.dataplane is not None and self.runner is not None
        dataplane, notify = self.dataplane, self.runner.suspect_drift
        try:
            await self.worker.call(lambda: dataplane.watch_drift(notify))
        except Exception:  # the full resync still repairs: never fatal
            log.exception("cannot watch for changes to our rules by other processes; "
                          "they are repaired at the next full sync only",
                          extra={"mode": dataplane.mode})

    async def shutdown(self) -> None:
        log.info("stopping; the rules stay in place")
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.watch is not None:
            await self.watch.stop()
        await self.hc_ports.close()
        for runner in self._http:
            await runner.cleanup()
        self._http.clear()
        if self.api is not None:
            await self.api.close()
            self.api = None
        if self.dataplane is not None:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await self.worker.call(self.dataplane.close)
            except TimeoutError:
                log.warning("the data plane is still busy (a sync in progress); leaving it")
            except Exception:
                log.exception("closing the data plane failed")
            self.dataplane = None
        self.worker.stop(timeout=0)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception(),
                      extra={"task": task.get_name()})

    # --- events ----------------------------------------------------------------------

    def _on_event(self, ev: WatchEvent) -> None:
        kind = ev.resource.kind
        model = self.model
        if kind == "Node":
            eligible = ev.type != "DELETED" and node_eligible(ev.obj)
            if eligible != self.health.node_eligible:
                log.warning("node is %s", "eligible again" if eligible else
                            "being deleted: /healthz reports unhealthy",
                            extra={"node": self.config.node_name})
            self.health.node_eligible = eligible
            if ev.obj is not None and ev.type != "DELETED":
                apply_object(model, ev.obj, self.config.endpoints_source)
        else:
            if ev.type == "DELETED":
                delete_object(model, kind, ev.namespace, ev.name)
            elif ev.obj is not None:
                apply_object(model, ev.obj, self.config.endpoints_source)
            if kind == "Service":
                self.changes.service(ev.namespace, ev.name)
                self.metrics.service_changes.inc()
            else:
                self.changes.endpoints(ev.namespace, _service_of(ev), ev.name)
                self.metrics.endpoint_changes.inc()
            if log.isEnabledFor(_EVENT_LEVEL):  # its fields not made for every listed item
                log.log(_EVENT_LEVEL, "event", extra={"type": ev.type, "kind": kind,
                                                      "object": f"{ev.namespace}/{ev.name}"})
        if self.runner is not None and (not self.runner.initialized or model.has_dirty):
            self.runner.request()
            if not self.runner.initialized:
                self._arrived.set()

    def _synced(self, state: DesiredState, keys: frozenset[ServicePortKey]) -> None:
        self.first_synced.set()
        self._primary_warnings.check(state, keys)
        moved = state.primary_ips != self._hc_primary  # `primary` may listen elsewhere
        if self._local.update(state, keys) or moved:
            self._hc_primary = state.primary_ips
            self._spawn(self.hc_ports.update(self._local.wanted(), self._local.counts(),
                                             state.primary_ips),
                        "health check node ports")

    # --- /debug/dump -----------------------------------------------------------------

    async def refresh_traffic(self) -> None:
        """The kernel's traffic counters (server/traffic.py)."""
        if self.dataplane is not None:
            priority = self.runner.priority if self.runner is not None else None
            await self.traffic.refresh(
                functools.partial(_read_traffic, self.worker, self.dataplane, priority),
                DUMP_RULES_TIMEOUT)

    async def debug_dump(self, service: str | None) -> dict[str, Any]:
        await self.refresh_traffic()
        applied, note = await _applied_rules(self.worker, self.dataplane,
                                             selected_keys(self.model, service))
        st = self.health.status()
        health = {
            "healthy": st.healthy, "ready": st.ready, "node_eligible": st.node_eligible,
            "first_sync_done": st.first_sync_done,
            "oldest_change_waiting_seconds": (
                round(st.oldest_queued_age, 3) if st.oldest_queued_age is not None else None),
            "threshold_seconds": self.health.threshold,
            "health_check_node_ports": {f"{ns}/{name}": port for (ns, name), port
                                        in sorted(self.hc_ports.open_ports.items())},
        }
        watch: dict[str, Any] = {
            "endpoints_source": self.config.endpoints_source.value,
            "endpoints_resource": str(self.endpoints_resource) if self.endpoints_resource
            else None,
            "synced": self.watch.synced if self.watch is not None else False,
            "resources": {} if self.watch is None else {
                str(r.resource): {**_stats(r.stats), "resource_version": r.resource_version,
                                  "objects": r.object_count}
                for r in self.watch.reflectors},
        }
        history = self.runner.history if self.runner is not None else ()
        return build_dump(
            config={**self.config.as_dict(), "healthz-threshold": format_duration(
                self.health.threshold)},
            model=self.model, applied=applied, applied_note=note, traffic=self.traffic.ports,
            syncs=[r.as_dict() for r in reversed(history)],
            health=health, watch=watch, service=service,
            pacing=self.runner.pacing() if self.runner is not None else None,
            nodeports=(self.config.nodeport_addresses, self.config.nodeport_primary))


async def _read_traffic(worker: Worker, dp: DataPlane, priority: Priority | None
                        ) -> tuple[Mapping[ServicePortKey, PortTraffic], float]:
    """A traffic reading: what to read taken on the data plane's thread, read on a thread
    of the reading's own, pausing for changes (common/priority.py); and the seconds it
    took, both together."""
    def begin() -> tuple[TrafficRead, float]:
        began = time.perf_counter()
        pauses = offer_lock if priority is None else priority.reading_pauses()
        return dp.traffic_reader(pauses), time.perf_counter() - began

    reader, held = await worker.call(begin)
    began = time.perf_counter()
    ports = await asyncio.to_thread(reader)
    return ports, held + time.perf_counter() - began


async def _applied_rules(worker: Worker, dp: DataPlane | None, keys: Sequence[ServicePortKey]
                         ) -> tuple[Mapping[ServicePortKey, Sequence[str]] | None, str | None]:
    """The dump's applied_rules, read on the data plane's thread, or why not."""
    if dp is None:
        return None, "the data plane is not running"
    try:
        async with asyncio.timeout(DUMP_RULES_TIMEOUT):
            rules = await worker.call(lambda: {k: list(dp.applied_rules(k)) for k in keys})
    except TimeoutError:
        return None, (f"the data plane was busy for {DUMP_RULES_TIMEOUT:g}s (a sync in "
                      "progress, or blocked); applied_rules left out")
    except Exception as exc:
        return None, f"reading applied rules failed: {exc}"
    return rules, None


def _service_of(ev: WatchEvent) -> str | None:
    if ev.resource.kind == "Endpoints":
        return ev.name
    # The object as served: any field may have the wrong type (metadata []).
    meta = (ev.obj or {}).get("metadata")
    labels = meta.get("labels") if isinstance(meta, dict) else None
    name = labels.get(LABEL_SERVICE_NAME) if isinstance(labels, dict) else None
    return name if isinstance(name, str) and name else None


def _stats(stats: object) -> dict[str, Any]:
    return {name: getattr(stats, name) for name in stats.__slots__}  # type: ignore[attr-defined]


async def _either(event: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wait for `event` or `stop`; whether `event` came (and `stop` did not)."""
    waits = [asyncio.ensure_future(e.wait()) for e in (event, stop)]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for fut in waits:
            fut.cancel()
    return event.is_set() and not stop.is_set()


async def _wait(stop: asyncio.Event, delay: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay):
            await stop.wait()
