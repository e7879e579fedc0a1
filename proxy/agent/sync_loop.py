"""The sync loop: dirty service ports -> resolve -> data plane -> kernel, at the pace
`SyncSchedule` allows, with health, metrics and a history of what each sync did.

Resolving runs on the event loop (the model is only ever touched there); the data plane
runs on its worker thread. A failed apply is retried with backoff as a full sync, and
the changes it carried stay pending (for /healthz, the pending gauges and the latency
histogram) until a sync applies them.

What a sync costs, for the CPU budget (schedule.py): the CPU time of the event loop's
thread while it resolves, of the worker thread while it renders and applies, and of the
child processes reaped meanwhile (`iptables-restore`). Per thread rather than the
process's total, because watch events decoded and scrapes answered while the worker
applies are not the sync's: charging them would delay syncs without saving that CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.agent.changes import ChangeBatch, ChangeLog
from proxy.agent.logs import V
from proxy.agent.schedule import DEFAULT_CPU_BUDGET, HELD_BY_BUDGET, SyncSchedule, Trigger
from proxy.agent.worker import Worker
from proxy.config.options import format_cpu_budget
from proxy.dataplane.base import ApplyError, DataPlane, SyncReport
from proxy.dataplane.common.collector import held
from proxy.dataplane.common.priority import Priority
from proxy.model.snapshot import DesiredState
from proxy.model.tracker import ClusterModel
from proxy.model.types import ServicePortKey
from proxy.server.health import ProxyHealth
from proxy.server.metrics import AgentMetrics

log = logging.getLogger(__name__)

HISTORY = 32  # syncs kept for /debug/dump
CHANGED_SHOWN = 25  # service ports listed per sync record; the rest are counted
RETRY_MAX = 30.0
HOUSEKEEPING_INTERVAL = 10.0
# After a report of a foreign change, wait this long for the rest of it (a firewall
# script is many commands) before reading our rules back: one check, not one per command.
DRIFT_SETTLE = 0.1
DRIFT_REASONS_KEPT = 5


@dataclass(frozen=True, slots=True)
class SyncRecord:
    """One sync, as /debug/dump shows it."""

    started: float  # wall clock
    duration: float
    trigger: str
    full: bool
    changed: tuple[str, ...]  # service ports whose desired state changed (first few)
    changed_count: int
    written: int = 0
    removed: int = 0
    operations: int = 0
    apply_seconds: float = 0.0
    conntrack_cleared: int = 0
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.started))
                       + f".{int(self.started % 1 * 1000):03d}Z",
            "duration_seconds": round(self.duration, 6),
            "trigger": self.trigger,
            "full": self.full,
            "changed": list(self.changed),
            "changed_count": self.changed_count,
            "written": self.written,
            "removed": self.removed,
            "operations": self.operations,
            "apply_seconds": round(self.apply_seconds, 6),
            "conntrack_cleared": self.conntrack_cleared,
            "error": self.error,
            "details": self.details,
        }


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (the tools a data plane ran)."""
    t = os.times()
    return t.children_user + t.children_system


def _refs(keys: Iterable[ServicePortKey]) -> set[tuple[str, str]]:
    return {(k.namespace, k.name) for k in keys}


class SyncLoop:
    def __init__(
        self,
        model: ClusterModel,
        dataplane: DataPlane,
        worker: Worker,
        *,
        min_sync_period: float | None,
        sync_period: float,
        cpu_budget: float | None = DEFAULT_CPU_BUDGET,
        metrics: AgentMetrics,
        health: ProxyHealth,
        changes: ChangeLog,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        started_at: float | None = None,
        burst: int = 2,
        on_synced: Callable[[DesiredState, frozenset[ServicePortKey]], None] | None = None,
        on_settled: Callable[[], None] | None = None,
        housekeeping_interval: float = HOUSEKEEPING_INTERVAL,
        thread_cpu: Callable[[], float] = time.thread_time,
        process_children_cpu: Callable[[], float] = children_cpu,
    ) -> None:
        self.model, self.dataplane, self.worker = model, dataplane, worker
        # A change's sync marked under way, for a traffic reading to give way to it.
        self.priority = Priority()
        self.metrics, self.health, self.changes = metrics, health, changes
        # Read when scraped: set at every event they were 2 % of the first lists' work.
        metrics.service_changes_pending.set_function(lambda: self.changes.pending_services)
        metrics.endpoint_changes_pending.set_function(lambda: self.changes.pending_endpoints)
        self._clock, self._wall = clock, wall
        self.sync_period = sync_period
        self.schedule = SyncSchedule(min_sync_period, sync_period, burst, now=clock(),
                                     cpu_budget=cpu_budget)
        self._thread_cpu, self._children_cpu = thread_cpu, process_children_cpu
        self._budget_held: tuple[float, int] | None = None  # since when, syncs held
        self.history: deque[SyncRecord] = deque(maxlen=HISTORY)
        self.on_synced = on_synced
        # Called once, when the work the data plane left for after the first sync is
        # done (its housekeeping no longer pending): the start is over.
        self.on_settled = on_settled
        self.housekeeping_interval = housekeeping_interval
        self._started_at = clock() if started_at is None else started_at
        self._wake = asyncio.Event()
        self._need_full = True
        # Another process changed our rules: the next sync rewrites them all, in parts
        # where the data plane does its resync so (begin_resync), else whole.
        self._repair = False
        self._last_full: float | None = None
        self._unapplied: set[ServicePortKey] = set()  # desired changes not yet applied
        self._failures = 0
        self.initialized = False
        self.syncs = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drift_reasons: list[str] = []  # reports of foreign changes not yet checked
        self._drift_due: float | None = None

    # --- inputs ----------------------------------------------------------------------

    def request(self) -> None:
        """A change arrived: sync as soon as the pacing allows. Before the first sync
        changes only accumulate (as upstream, health counts them from then on)."""
        if self.initialized:
            self.health.queued()
            self.metrics.last_queued.set(self._wall())
            self.schedule.request()
            self._wake.set()

    def start(self) -> None:
        """Every watched resource has listed: the first (full) sync may run."""
        self.initialized = True
        self.health.queued()
        self.metrics.last_queued.set(self._wall())
        self.schedule.request(Trigger.INITIAL)
        self._wake.set()

    def suspect_drift(self, reason: str) -> None:
        """Another process may have changed our rules (the data plane's watcher says so,
        from its own thread): check them soon, and repair them if it did."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(self._suspected, reason)

    def _suspected(self, reason: str) -> None:
        if len(self._drift_reasons) < DRIFT_REASONS_KEPT:
            self._drift_reasons.append(reason)
        if self._drift_due is None:
            self._drift_due = self._clock() + DRIFT_SETTLE
        self._wake.set()

    # --- the loop --------------------------------------------------------------------

    async def run(self) -> None:
        """Sync whenever due, until cancelled."""
        self._loop = asyncio.get_running_loop()
        next_housekeeping = self._clock() + self.housekeeping_interval
        while True:
            self._wake.clear()
            if not self.initialized:
                # Nothing is due before the first sync, however long the lists take (an
                # API server away at boot: minutes). start() wakes the loop. (A timeout
                # here spun a core once the housekeeping time had passed.)
                await self._wake.wait()
                next_housekeeping = self._clock() + self.housekeeping_interval
                continue
            now = self._clock()
            trigger = self.schedule.start(now)
            if trigger is not None:
                await self._sync(trigger)
                if trigger is Trigger.INITIAL or self.dataplane.housekeeping_pending():
                    # Now, unless a sync is due: what the data plane left for after its
                    # first sync (a restart's kept state, nftables/restart_steps.py) or
                    # a resync begun (nftables/resync_steps.py).
                    next_housekeeping = self._clock()
                continue
            if self._drift_due is not None and now >= self._drift_due:
                await self._check_drift()
                continue
            if now >= next_housekeeping:
                await self._housekeeping()
                # Work left for later parts (a change goes first): right away.
                pending = self.dataplane.housekeeping_pending()
                next_housekeeping = self._clock() + (
                    0.0 if pending else self.housekeeping_interval)
                if not pending and self.on_settled is not None:
                    self.on_settled()
                    self.on_settled = None
                continue
            due = self.schedule.next_due(now)
            timeout = next_housekeeping - now
            if due is not None:
                timeout = min(timeout, due - now)
            if self._drift_due is not None:
                timeout = min(timeout, self._drift_due - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, timeout)):
                    await self._wake.wait()

    async def _check_drift(self) -> None:
        reasons, self._drift_reasons, self._drift_due = self._drift_reasons, [], None
        if self._need_full or self._repair:
            return  # the next sync rewrites everything anyway
        self.metrics.drift_checks.inc()
        try:
            found = await self.worker.call(self.dataplane.check_drift)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("checking our rules after a foreign change failed",
                          extra={"mode": self.dataplane.mode, "change": reasons})
            return
        if not found:
            log.log(V(2), "our rules are intact after a change by another process",
                    extra={"change": reasons})
            return
        self.metrics.drift_repairs.inc()
        self._repair = True
        self.schedule.request(Trigger.DRIFT)
        log.warning("another process changed our rules; rewriting them all",
                    extra={"mode": self.dataplane.mode, "change": reasons,
                           "differences": found})

    async def _housekeeping(self) -> None:
        try:
            deleted = await self.worker.call(self._housekeep)
            self.metrics.count_conntrack(deleted or {})
        except ApplyError as exc:  # a part of a resync refused: rewrite it all (logged)
            self._need_full = True
            self.schedule.request(Trigger.RETRY)
            log.warning("data plane housekeeping failed; next sync is full",
                        extra={"mode": self.dataplane.mode, "error": str(exc)})
        except Exception:
            log.exception("data plane housekeeping failed", extra={"mode": self.dataplane.mode})

    def _housekeep(self) -> Mapping[str, int] | None:
        with held():  # a resync's or restart's part builds state, as a sync does
            return self.dataplane.housekeeping()

    def _note_held(self, start: float) -> None:
        """Count a sync the limits held back; log when the CPU budget starts holding
        syncs back and when it stops, once each, not per sync."""
        held = self.schedule.held_by
        if held is not None:
            self.metrics.syncs_held.labels(held).inc()
        budget = self.schedule.budget
        if held == HELD_BY_BUDGET and budget is not None:
            if self._budget_held is None:
                self._budget_held = (start, 0)
                log.info("sync CPU budget spent: changes now wait and are batched",
                         extra={"budget": format_cpu_budget(budget.share),
                                "credit": f"{budget.credit:.3f}s"})
            since, count = self._budget_held
            self._budget_held = (since, count + 1)
        elif self._budget_held is not None:
            since, count = self._budget_held
            self._budget_held = None
            log.info("sync CPU budget no longer holding syncs back",
                     extra={"held_syncs": count, "for": f"{start - since:.3f}s"})

    def pacing(self) -> dict[str, Any]:
        """How syncs are paced now, for /debug/dump."""
        view = self.schedule.view(self._clock())
        credit = view.credit_cpu_seconds
        return {
            "mode": view.mode,
            "min_sync_period_seconds": view.min_sync_period,
            "burst": view.burst if view.min_sync_period is not None else None,
            "cpu_budget": format_cpu_budget(view.cpu_budget),
            "credit_cpu_seconds": round(credit, 6) if credit is not None else None,
            "holding": view.holding,
            "syncs_held_back": view.held,
        }

    async def _sync(self, trigger: Trigger) -> None:
        """A sync; one for changes marked under way from its start to its end (resolving
        included), for a traffic reading to give way to it (common/priority.py)."""
        if trigger is not Trigger.CHANGE:
            await self._sync_now(trigger)
            return
        with self.priority.change():
            await self._sync_now(trigger)

    async def _sync_now(self, trigger: Trigger) -> None:
        start = self._clock()
        started_wall = self._wall()
        self._note_held(start)
        full = (self._need_full or self._repair or trigger is not Trigger.CHANGE
                or self._last_full is None or start - self._last_full >= self.sync_period)
        # The --sync-period resync (periodic, or the change sync it turns full under
        # churn) is the agent's own upkeep, not what changes cost: charged, its CPU (1.5 s
        # at 10,000 services in nftables mode) would hold the next changes some 6 s.
        upkeep = full and not self._need_full and trigger in (Trigger.CHANGE,
                                                              Trigger.PERIODIC)
        # Both may go a part at a time: over rules the data plane still knows.
        repair = self._repair and not self._need_full
        in_parts = upkeep or repair
        batch = self.changes.checkout()
        self.health.sync_started()
        children, began = self._children_cpu(), self._thread_cpu()
        state = self.model.resolve()
        cpu = [self._thread_cpu() - began]  # the worker adds its own
        parted: list[bool] = []  # the resync left to the data plane's housekeeping

        def apply() -> SyncReport:
            began = self._thread_cpu()  # the worker's thread, from here
            try:
                with held():  # what a sync builds stays: not rescanned as it grows
                    if in_parts and self.dataplane.begin_resync(repair):
                        parted.append(True)
                        return self.dataplane.sync(state, False)
                    return self.dataplane.sync(state, full)
            finally:
                cpu.append(self._thread_cpu() - began)

        self._unapplied |= state.changed
        try:
            report = await self.worker.call(apply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # ApplyError, or a data-plane bug: never stop syncing
            self._failed(trigger, full, start, started_wall, batch, exc)
            return
        finally:
            cost = max(0.0, sum(cpu) + self._children_cpu() - children)
            self.metrics.sync_cpu.inc(cost)
            self.schedule.finish(self._clock(), 0.0 if upkeep else cost)
        if parted:  # begun: its parts follow as housekeeping, this sync was partial
            self._last_full, full = start, False
        self._succeeded(trigger, full, start, started_wall, batch, state, report)

    def _changed_fields(self) -> tuple[tuple[str, ...], int]:
        first = heapq.nsmallest(CHANGED_SHOWN, self._unapplied,
                                key=lambda k: (k.namespace, k.name, k.port, k.family))
        return tuple(str(k) for k in first), len(self._unapplied)

    def _succeeded(self, trigger: Trigger, full: bool, start: float, started_wall: float,
                   batch: ChangeBatch, state: DesiredState, report: SyncReport) -> None:
        end = self._clock()
        duration = end - start
        kind = "full" if full else "partial"
        m = self.metrics
        m.sync_duration.observe(duration)
        (m.sync_full_duration if full else m.sync_partial_duration).observe(duration)
        m.syncs.labels(kind, "ok").inc()
        m.last_sync.set(self._wall())
        m.count_conntrack(report.conntrack_deleted)
        m.tcp_flows_reset.inc(report.flows_reset)
        m.count_mode(report.counted)
        if trigger is not Trigger.INITIAL:
            # Start-up is not programming latency: its changes are the initial list.
            touched = _refs(self._unapplied)
            for ref, arrived in batch.arrivals.items():
                if ref in touched:
                    m.network_programming.observe(max(0.0, end - arrived))
        changed, changed_count = self._changed_fields()
        applied = frozenset(self._unapplied)
        self._unapplied.clear()
        self._need_full = self._repair = False
        self._failures = 0
        if full:
            self._last_full = start
        self.syncs += 1
        self.health.updated()
        record = SyncRecord(
            started=started_wall, duration=duration, trigger=trigger.value, full=full,
            changed=changed, changed_count=changed_count, written=len(report.written),
            removed=len(report.removed), operations=report.operations,
            apply_seconds=report.apply_seconds, conntrack_cleared=report.conntrack_cleared,
            details=dict(report.details))
        self.history.append(record)
        extra = {"trigger": trigger.value, "full": full, "duration": f"{duration:.4f}s",
                 "service_ports": len(state), "changed": changed_count,
                 "written": record.written, "removed": record.removed,
                 "operations": report.operations}
        if trigger is Trigger.INITIAL:
            startup = end - self._started_at
            m.first_sync.set(startup)
            log.info("first sync done: rules programmed for the whole cluster",
                     extra={**extra, "since_start": f"{startup:.3f}s"})
        elif full:
            log.info("full sync done", extra=extra)
        else:
            log.log(V(2), "sync done", extra=extra)
        if self.on_synced is not None:
            try:
                self.on_synced(state, applied)
            except Exception:
                log.exception("post-sync hook failed")

    def _failed(self, trigger: Trigger, full: bool, start: float, started_wall: float,
                batch: ChangeBatch, exc: Exception) -> None:
        duration = self._clock() - start
        kind = "full" if full else "partial"
        m = self.metrics
        m.syncs.labels(kind, "error").inc()
        self.changes.restore(batch)
        self.health.sync_failed()
        self._need_full = True
        self._failures += 1
        # Upstream retries after --sync-period (30s there); ours is an hour, so back off
        # from --min-sync-period if set (at least 1s) up to 30s instead.
        base = max(1.0, self.schedule.min_interval or 0.0)
        delay = min(RETRY_MAX, base * 2 ** (self._failures - 1))
        self.schedule.retry_after(self._clock(), delay)
        mode = self.dataplane.mode
        extra: dict[str, Any] = {"trigger": trigger.value, "full": full, "mode": mode,
                                 "retry_in": f"{delay:g}s", "failures": self._failures}
        if isinstance(exc, ApplyError):
            m.apply_failures.labels(mode).inc()
            m.count_mode(exc.counted)
            if exc.offending:
                extra["offending"] = exc.offending
            log.error("sync failed; the previous rules stay in place",
                      extra={**extra, "error": str(exc)})
            message = str(exc)
        else:
            log.error("sync failed with an unexpected error; the previous rules stay in "
                      "place", exc_info=exc, extra=extra)
            message = f"{type(exc).__name__}: {exc}"
        changed, changed_count = self._changed_fields()
        self.history.append(SyncRecord(
            started=started_wall, duration=duration, trigger=trigger.value, full=full,
            changed=changed, changed_count=changed_count, error=message))
