"""The sync runner: resolve -> data plane on its own thread, pacing, failures, metrics,
history. A fake clock drives the pacing (the runner is woken after each clock step, never
slept on); the data plane is a recording double of our own DataPlane interface."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import pytest

from proxy.agent.changes import ChangeLog
from proxy.agent.sync_loop import SyncLoop
from proxy.agent.worker import Worker
from proxy.dataplane.modes import IPTABLES_RESTORE_FAILURES
from proxy.kube.ingest import apply_object
from proxy.model.tracker import ClusterModel
from proxy.server.health import ProxyHealth
from proxy.server.metrics import AgentMetrics
from tests.integration.agent_harness import FakeDataPlane
from tests.unit.builders import ep, eps_slice, service


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class Bench:
    def __init__(self, min_sync: float | None = 1.0, sync_period: float = 3600.0,
                 **loop: Any) -> None:
        self.clock = Clock()
        self.model = ClusterModel("node-a")
        self.dp = FakeDataPlane()
        self.worker = Worker()
        self.metrics = AgentMetrics()
        self.health = ProxyHealth(60.0, clock=self.clock)
        self.changes = ChangeLog(self.clock)
        self.synced: list[Any] = []
        self.runner = SyncLoop(
            self.model, self.dp, self.worker, min_sync_period=min_sync,
            sync_period=sync_period, metrics=self.metrics, health=self.health,
            changes=self.changes, clock=self.clock, wall=lambda: 1.7e9 + self.clock.now,
            started_at=self.clock.now - 1.0,
            on_synced=lambda state, keys: self.synced.append(keys), **loop)
        self.runner._wake = WakeSeen()

    def event(self, obj: dict[str, Any]) -> None:
        """What the agent's watch handler does for one event."""
        apply_object(self.model, obj)
        meta = obj["metadata"]
        if obj["kind"] == "Service":
            self.changes.service(meta["namespace"], meta["name"])
        else:
            self.changes.endpoints(meta["namespace"],
                                   meta["labels"]["kubernetes.io/service-name"], meta["name"])
        self.runner.request()

    def metric(self, name: str) -> float:
        value = self.metrics.registry.get_sample_value(name)
        return 0.0 if value is None else value


class WakeSeen(asyncio.Event):
    """The runner's wake-up event, telling whether the runner is parked on it: idle, with
    what it did recorded (its metrics, history, and when the next sync or housekeeping is
    due, read from the clock)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiters = 0

    async def wait(self) -> Literal[True]:
        self.waiters += 1
        try:
            return await super().wait()
        finally:
            self.waiters -= 1

    def parked(self) -> bool:
        return self.waiters > 0 and not self.is_set()


SETTLE_DEADLINE = 30.0  # seconds of real time: the runner's worker thread may be starved


async def settle(bench: Bench, cond: Callable[[], bool], what: str) -> None:
    """Let the runner work (real loop, fake clock) until `cond` holds with the runner
    parked, polling until a deadline of real time (a count of polls was too few on a
    loaded machine). The data plane double counts a sync or a housekeeping on the worker
    thread, before the runner is back from it: a test stepping the clock on that count
    alone raced the runner's own reading of the clock."""
    wake = bench.runner._wake
    assert isinstance(wake, WakeSeen)
    deadline = time.monotonic() + SETTLE_DEADLINE
    while time.monotonic() < deadline:
        if cond() and wake.parked():
            return
        bench.runner._wake.set()
        await asyncio.sleep(0.001)
    raise AssertionError(f"runner never got to: {what}")


async def started(b: Bench, housekeeping_interval: float) -> None:
    """WEB synced by the first sync, and the housekeeping right after it done."""
    b.runner.housekeeping_interval = housekeeping_interval
    b.event(WEB)
    b.runner.start()
    await settle(b, lambda: len(b.dp.syncs) == 1 and b.dp.housekept == 1, "first sync")


def run(test: Callable[[Bench], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        bench = Bench(**kw)
        task = asyncio.create_task(bench.runner.run())
        try:
            await test(bench)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            bench.dp.gate.set()
            bench.worker.stop(5)

    asyncio.run(main())


WEB = service("web", ips=("198.18.128.10",))


def web_slice(*ips: str) -> dict[str, Any]:
    return eps_slice("web-1", [ep(ip, node="node-a") for ip in ips], service_name="web")


def test_nothing_syncs_before_start_then_one_full_sync_of_everything() -> None:
    async def go(b: Bench) -> None:
        b.event(WEB)
        b.event(web_slice("198.18.1.10"))
        for _ in range(20):
            b.runner._wake.set()
            await asyncio.sleep(0.001)
        assert b.dp.syncs == []
        assert b.metric("kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 1
        b.runner.start()
        await settle(b, lambda: len(b.dp.syncs) == 1, "first sync")
        full, state = b.dp.syncs[0]
        assert full and len(state) == 1
        assert b.dp.endpoints("ns/web", "http") == {"198.18.1.10:8080"}
        assert b.dp.threads and threading.get_ident() not in b.dp.threads
        assert b.health.status().ready
        assert b.metric("sliceproxy_first_sync_seconds") == pytest.approx(1.0)
        # Start-up is not programming latency.
        assert b.metric("kubeproxy_network_programming_duration_seconds_count") == 0
        assert b.runner.history[-1].trigger == "initial"

    run(go)


def test_before_start_the_loop_sleeps_however_long_the_lists_take() -> None:
    # An API server away at boot holds the first sync back for minutes: past the
    # housekeeping time the loop spun (a core of CPU), reading the clock each turn.
    async def go(b: Bench) -> None:
        await asyncio.sleep(0.001)  # the loop has begun, its housekeeping time set
        b.clock.now += 3 * b.runner.housekeeping_interval
        b.event(WEB)
        reads = b.clock.reads
        b.runner._wake.set()  # as any wake-up would, once the lists take that long
        for _ in range(50):
            await asyncio.sleep(0.001)
        assert b.clock.reads - reads < 5
        b.runner.start()
        await settle(b, lambda: len(b.dp.syncs) == 1, "first sync")

    run(go)


def test_changes_sync_partially_and_are_paced_by_min_sync_period() -> None:
    async def go(b: Bench) -> None:
        b.event(WEB)
        b.runner.start()
        await settle(b, lambda: len(b.dp.syncs) == 1, "first sync")
        b.clock.now += 10  # a quiet period: both burst tokens are back
        b.event(web_slice("198.18.1.10"))
        await settle(b, lambda: len(b.dp.syncs) == 2, "immediate sync")
        b.clock.now += 0.2
        b.event(web_slice("198.18.1.11"))
        await settle(b, lambda: len(b.dp.syncs) == 3, "second burst sync")
        # The burst is spent: these three coalesce into one sync, not before a token.
        for ip in ("198.18.1.12", "198.18.1.13", "198.18.1.14"):
            b.clock.now += 0.1
            b.event(web_slice(ip))
        for _ in range(30):
            b.runner._wake.set()
            await asyncio.sleep(0.001)
        assert len(b.dp.syncs) == 3
        b.clock.now += 1.0
        await settle(b, lambda: len(b.dp.syncs) == 4, "coalesced sync")
        assert [full for full, _ in b.dp.syncs] == [True, False, False, False]
        assert b.dp.endpoints("ns/web", "http") == {"198.18.1.14:8080"}
        # Latency from the first change of each batch to its apply, on the fake clock.
        assert b.metric("kubeproxy_network_programming_duration_seconds_count") == 3
        assert b.metric("kubeproxy_network_programming_duration_seconds_sum") == pytest.approx(
            0.0 + 0.0 + (b.clock.now - (b.clock.now - 1.0 - 0.2)))
        assert b.metrics.registry.get_sample_value(
            "sliceproxy_syncs_total", {"kind": "partial", "result": "ok"}) == 3
        record = b.runner.history[-1]
        assert record.trigger == "change" and not record.full
        assert record.changed == ("ns/web:http (IPv4)",)

    run(go)


def test_a_failed_apply_is_retried_as_full_and_keeps_its_changes_pending() -> None:
    async def go(b: Bench) -> None:
        b.event(WEB)
        b.runner.start()
        await settle(b, lambda: len(b.dp.syncs) == 1, "first sync")
        b.clock.now += 10
        b.dp.fail_next = 1
        # The failure's own counters, as the plane reports them: counted whatever the
        # mode (this one is "fake"), the agent knowing no mode's metrics.
        b.dp.counted = {IPTABLES_RESTORE_FAILURES.name: 1}
        b.event(web_slice("198.18.1.10"))
        await settle(b, lambda: len(b.runner.history) == 2, "failed sync")
        failed = b.runner.history[-1]
        assert failed.error == "injected failure" and not failed.full
        assert b.metric("kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 1
        assert b.health.status().oldest_queued_age is not None
        assert b.metrics.registry.get_sample_value(
            "sliceproxy_sync_apply_failures_total", {"mode": "fake"}) == 1
        assert b.metric(f"{IPTABLES_RESTORE_FAILURES.name}_total") == 1
        b.dp.counted = {}
        # The retry waits for its backoff (1s here), then runs as a full sync.
        b.clock.now += 0.5
        for _ in range(30):
            b.runner._wake.set()
            await asyncio.sleep(0.001)
        assert len(b.runner.history) == 2
        b.clock.now += 0.6
        await settle(b, lambda: len(b.dp.syncs) == 2, "retry")
        full, _ = b.dp.syncs[-1]
        assert full and b.runner.history[-1].trigger == "retry"
        assert b.dp.endpoints("ns/web", "http") == {"198.18.1.10:8080"}
        assert b.metric("kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 0
        assert b.health.status().oldest_queued_age is None
        # The retry's latency counts from the change's first arrival.
        assert b.metric("kubeproxy_network_programming_duration_seconds_sum") == pytest.approx(
            1.1)

    run(go)


def test_periodic_full_resync_and_full_after_sync_period_of_churn() -> None:
    async def go(b: Bench) -> None:
        b.event(WEB)
        b.runner.start()
        await settle(b, lambda: len(b.dp.syncs) == 1, "first sync")
        b.clock.now += 30
        await settle(b, lambda: len(b.dp.syncs) == 2, "periodic sync")
        assert b.dp.syncs[-1][0] and b.runner.history[-1].trigger == "periodic"
        # Constant churn never lets the periodic timer fire; the resync still happens.
        for i in range(40):
            b.clock.now += 1
            b.event(web_slice(f"198.18.1.{10 + i % 5}"))
            await settle(b, lambda n=i: len(b.dp.syncs) == 3 + n, "churn sync")
        kinds = [full for full, _ in b.dp.syncs[2:]]
        assert kinds.count(True) == 1 and kinds.index(True) == 29

    run(go, sync_period=30.0)


def test_housekeeping_runs_on_the_worker_between_syncs() -> None:
    async def go(b: Bench) -> None:
        b.runner.housekeeping_interval = 5.0
        b.runner.start()
        await settle(b, lambda: len(b.dp.syncs) == 1, "first sync")
        # Right after the first sync (what the data plane left for then: a restart's
        # kept state), then every interval, on the clock.
        await settle(b, lambda: b.dp.housekept == 1, "housekeeping after the first sync")
        b.clock.now += 6
        await settle(b, lambda: b.dp.housekept == 2, "housekeeping")
        assert threading.get_ident() not in b.dp.threads and len(b.dp.threads) == 1

    run(go)


@pytest.mark.usefixtures("collector_restored")
def watched(b: Bench, now: Callable[[], bool]) -> list[tuple[str, bool]]:
    """b's data-plane syncs ("full" or "change") and housekeeping, each recorded as it
    begins with what `now` says then."""
    seen: list[tuple[str, bool]] = []
    sync, housekeeping = b.dp.sync, b.dp.housekeeping

    def watched_sync(state: Any, full: bool = False) -> Any:
        seen.append(("full" if full else "change", now()))
        return sync(state, full)

    def watched_housekeeping() -> None:
        seen.append(("housekeeping", now()))
        housekeeping()

    b.dp.sync = watched_sync  # type: ignore[method-assign]
    b.dp.housekeeping = watched_housekeeping  # type: ignore[method-assign]
    return seen


def test_the_collector_is_held_off_while_the_data_plane_syncs_and_housekeeps() -> None:
    # What a sync builds stays: a collection while it is built rescans it (a full
    # sync at 10,000 services took half as long again with the collector on).
    async def go(b: Bench) -> None:
        seen = watched(b, gc.isenabled)
        await started(b, 5.0)
        b.event(web_slice("198.19.0.1"))
        b.clock.now += 2
        await settle(b, lambda: len(b.dp.syncs) == 2, "a change's sync")
        assert seen == [("full", False), ("housekeeping", False), ("change", False)]
        assert gc.isenabled()  # back on between them

    run(go)


def test_a_changes_sync_is_marked_under_way_for_a_reading_to_give_way_to() -> None:
    # A traffic reading on its own thread waits for a change's sync at its pauses
    # (common/priority.py); the first (full) sync and housekeeping are not waited for.
    async def go(b: Bench) -> None:
        seen = watched(b, lambda: b.runner.priority.under_way)
        await started(b, 5.0)
        b.event(web_slice("198.19.0.1"))
        b.clock.now += 2
        await settle(b, lambda: len(b.dp.syncs) == 2, "a change's sync")
        assert seen == [("full", False), ("housekeeping", False), ("change", True)]
        assert not b.runner.priority.under_way  # and no longer once synced

    run(go)


def test_housekeeping_with_work_left_runs_again_without_waiting_the_interval() -> None:
    async def go(b: Bench) -> None:
        b.runner.housekeeping_interval = 5.0
        b.dp.parts_left = 3  # three parts after the first sync (nftables' input marks)
        settled: list[int] = []  # housekeeping runs when the start was declared over
        b.runner.on_settled = lambda: settled.append(b.dp.housekept)
        b.runner.start()
        await settle(b, lambda: b.dp.housekept == 3, "every part, the clock standing still")
        assert not b.dp.housekeeping_pending()
        await settle(b, lambda: settled == [3], "the start declared over once the last is done")
        for _ in range(20):  # then the interval again
            b.runner._wake.set()
            await asyncio.sleep(0.001)
        assert b.dp.housekept == 3
        b.clock.now += 6
        await settle(b, lambda: b.dp.housekept == 4, "housekeeping after the interval")
        assert settled == [3]  # once

    run(go)


def test_a_resync_the_data_plane_takes_in_parts_is_a_partial_sync_then_its_parts() -> None:
    """nftables' periodic resync a table at a time: the sync the period makes full is
    partial, the parts follow at once as housekeeping, and the next resync comes a
    period after this one began."""
    async def go(b: Bench) -> None:
        await started(b, housekeeping_interval=100.0)
        b.dp.resync_parts = 3
        b.clock.now += 30
        await settle(b, lambda: len(b.dp.syncs) == 2, "the periodic sync")
        assert b.dp.resyncs == 1 and b.dp.repairs == 0 and not b.dp.syncs[-1][0]
        assert b.runner.history[-1].trigger == "periodic" and not b.runner.history[-1].full
        # Its three parts, the clock standing still, long before the interval.
        await settle(b, lambda: b.dp.housekept == 4, "the resync's parts")
        b.clock.now += 1
        b.event(web_slice("198.18.1.10"))  # a change: partial, no resync begun
        await settle(b, lambda: len(b.dp.syncs) == 3, "a change")
        assert not b.dp.syncs[-1][0] and b.dp.resyncs == 1
        b.clock.now += 28
        for _ in range(20):
            b.runner._wake.set()
            await asyncio.sleep(0.001)
        assert len(b.dp.syncs) == 3 and b.dp.resyncs == 1
        b.clock.now += 30
        await settle(b, lambda: b.dp.resyncs == 2, "the next resync, a period later")

    run(go, sync_period=30.0)


def test_a_repair_of_drift_goes_in_parts_where_the_data_plane_resyncs_so() -> None:
    async def go(b: Bench) -> None:
        await started(b, housekeeping_interval=100.0)
        b.dp.resync_parts = 2
        b.dp.drift = ["IPv4: chain svc-web-http is missing"]
        b.runner.suspect_drift("someone")
        await settle(b, lambda: b.runner._drift_due is not None, "the report")
        b.clock.now += 1  # the drift check waits for the rest of the change
        await settle(b, lambda: len(b.dp.syncs) == 2, "the repair")
        assert b.runner.history[-1].trigger == "drift" and not b.dp.syncs[-1][0]
        assert b.dp.resyncs == b.dp.repairs == 1
        await settle(b, lambda: b.dp.housekept == 3, "its parts, at once")
        b.clock.now += 1
        b.event(web_slice("198.18.1.11"))  # the repair is over: a change is partial
        await settle(b, lambda: len(b.dp.syncs) == 3, "a change")
        assert not b.dp.syncs[-1][0] and b.dp.resyncs == 1

    run(go)


def test_a_part_of_housekeeping_refused_makes_the_next_sync_full_and_soon() -> None:
    async def go(b: Bench) -> None:
        await started(b, housekeeping_interval=5.0)
        b.dp.housekeeping_fails = 1
        b.clock.now += 6
        await settle(b, lambda: b.dp.housekept == 2, "the housekeeping refused")
        await settle(b, lambda: len(b.dp.syncs) == 2, "a sync after it, with no change")
        assert b.dp.syncs[-1][0] and b.runner.history[-1].trigger == "retry"

    run(go)


def test_post_sync_hook_gets_the_applied_keys() -> None:
    async def go(b: Bench) -> None:
        b.event(WEB)
        b.runner.start()
        await settle(b, lambda: len(b.synced) == 1, "hook")
        assert {k.name for k in b.synced[0]} == {"web"}
        b.clock.now += 10
        b.event(service("other", ips=("198.18.128.11",)))
        await settle(b, lambda: len(b.synced) == 2, "hook 2")
        assert {k.name for k in b.synced[1]} == {"other"}

    run(go)


def test_by_default_each_change_syncs_at_once_with_no_period_to_wait_for() -> None:
    """No --min-sync-period (the default): five changes 300 ms apart are five syncs, each
    the moment its change arrives (kube-proxy's 1s period would hold the third back)."""
    async def go(b: Bench) -> None:
        b.event(WEB)
        b.runner.start()
        await settle(b, lambda: len(b.dp.syncs) == 1, "first sync")
        for i in range(5):
            b.clock.now += 0.3
            b.event(web_slice(f"198.18.1.{10 + i}"))
            await settle(b, lambda n=i: len(b.dp.syncs) == 2 + n, f"change {i}")
        assert b.dp.endpoints("ns/web", "http") == {"198.18.1.14:8080"}
        assert b.metric("kubeproxy_network_programming_duration_seconds_count") == 5
        assert b.metric("kubeproxy_network_programming_duration_seconds_sum") == 0.0
        assert b.runner.pacing()["mode"] == "cost"
        assert b.runner.pacing()["syncs_held_back"] == {"cpu-budget": 0, "min-sync-period": 0}

    run(go, min_sync=None)


class FakeCpu:
    """Thread CPU time that advances 0.25 s at every reading: each sync costs 0.5 s
    (0.25 resolving, 0.25 applying)."""

    def __init__(self) -> None:
        self.value = 0.0

    def __call__(self) -> float:
        self.value += 0.25
        return self.value


def test_the_cpu_budget_holds_expensive_syncs_back_and_says_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="proxy.agent.sync_loop")

    def held_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "CPU budget" in r.getMessage()]

    async def go(b: Bench) -> None:
        b.event(WEB)
        b.runner.start()
        await settle(b, lambda: len(b.dp.syncs) == 1, "first sync")  # not charged
        b.clock.now += 10
        b.event(web_slice("198.18.1.10"))  # idle: at once, and 0.3 CPU-s overdrawn
        await settle(b, lambda: len(b.dp.syncs) == 2, "first change")
        b.clock.now += 0.5
        b.event(web_slice("198.18.1.11"))
        b.event(web_slice("198.18.1.12"))
        # Held until the overdrawn 0.3 CPU-s is repaid at 20% of a core: 1.5 s after
        # the last sync started, the two changes then applied by one sync.
        b.clock.now += 0.99
        for _ in range(30):
            b.runner._wake.set()
            await asyncio.sleep(0.001)
        assert len(b.dp.syncs) == 2
        assert b.runner.pacing()["holding"] == "cpu-budget"
        assert b.runner.pacing()["credit_cpu_seconds"] < 0
        b.clock.now += 0.01
        await settle(b, lambda: len(b.dp.syncs) == 3, "held sync")
        assert b.dp.endpoints("ns/web", "http") == {"198.18.1.12:8080"}
        assert b.metric("sliceproxy_sync_cpu_seconds_total") == pytest.approx(1.5)
        assert b.metrics.registry.get_sample_value(
            "sliceproxy_syncs_held_back_total", {"reason": "cpu-budget"}) == 1
        assert held_lines() == ["sync CPU budget spent: changes now wait and are batched"]
        # Quiet: repaid; the next change syncs at once, and the log says it is over.
        b.clock.now += 10
        b.event(web_slice("198.18.1.13"))
        await settle(b, lambda: len(b.dp.syncs) == 4, "change after the burst")
        assert held_lines()[1:] == ["sync CPU budget no longer holding syncs back"]
        assert b.runner.pacing()["syncs_held_back"]["cpu-budget"] == 1

    run(go, min_sync=None, thread_cpu=FakeCpu(), process_children_cpu=lambda: 0.0)


def test_the_hourly_full_resync_is_not_charged_to_the_budget() -> None:
    """A full resync due to --sync-period costs what the cluster costs (seconds at
    10,000 services); it is upkeep, so the change after it is not held back for it,
    while a change sync of the same cost is."""
    async def go(b: Bench) -> None:
        b.event(WEB)
        b.runner.start()
        await settle(b, lambda: len(b.dp.syncs) == 1, "first sync")
        b.clock.now += 30
        await settle(b, lambda: len(b.dp.syncs) == 2, "periodic resync")
        assert b.runner.history[-1].trigger == "periodic" and b.dp.syncs[-1][0]
        assert b.metric("sliceproxy_sync_cpu_seconds_total") == pytest.approx(1.0)
        b.clock.now += 0.01
        b.event(web_slice("198.18.1.10"))  # right after 0.5 CPU-s of resync: at once
        await settle(b, lambda: len(b.dp.syncs) == 3, "change after the resync")
        assert not b.dp.syncs[-1][0]
        b.clock.now += 0.01
        b.event(web_slice("198.18.1.11"))  # after 0.5 CPU-s of change sync: held
        for _ in range(30):
            b.runner._wake.set()
            await asyncio.sleep(0.001)
        assert len(b.dp.syncs) == 3 and b.runner.pacing()["holding"] == "cpu-budget"

    run(go, min_sync=None, sync_period=30.0, thread_cpu=FakeCpu(),
        process_children_cpu=lambda: 0.0)
