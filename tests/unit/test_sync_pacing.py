"""Pacing by cost (the default: no --min-sync-period), on a fake clock with the syncs'
CPU given by the test: changes sync at once while the agent is idle, batch while a sync
runs, and the syncs' CPU stays within --sync-cpu-budget however many changes come.
kube-proxy's pacing (--min-sync-period set) is tests/unit/test_sync_schedule.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.agent.schedule import (
    HELD_BY_BUDGET,
    HELD_BY_PERIOD,
    CpuBudget,
    SyncSchedule,
    Trigger,
)

MAX = 3600.0
BUDGET = 0.2
CREDIT = BUDGET * 1.0  # one second of budget


def sync(s: SyncSchedule, now: float, cost: float, took: float | None = None) -> Trigger:
    """Start a sync at `now` (it must be due), running `took` seconds (its CPU if not
    given) and costing `cost` CPU-seconds; returns its trigger."""
    trigger = s.start(now)
    assert trigger is not None, f"no sync due at {now}"
    s.finish(now + (cost if took is None else took), cost)
    return trigger


def test_a_change_while_idle_syncs_at_once_however_recent_the_last_sync() -> None:
    s = SyncSchedule(None, MAX, now=0.0)
    for t in (10.0, 10.05, 10.1, 10.15):  # 50 ms apart: no period makes them wait
        s.request()
        assert s.next_due(t) == t
        sync(s, t, cost=0.005)
    assert s.held == {HELD_BY_BUDGET: 0, HELD_BY_PERIOD: 0}


def test_changes_during_a_sync_are_one_sync_right_when_it_ends() -> None:
    s = SyncSchedule(None, MAX, now=0.0)
    s.request()
    assert s.start(5.0) is Trigger.CHANGE
    for t in (5.01, 5.02, 5.03):
        s.request()
        assert s.next_due(t) is None  # running: nothing else starts
    s.finish(5.04, 0.03)
    assert s.next_due(5.04) == 5.04
    assert sync(s, 5.04, cost=0.01) is Trigger.CHANGE
    assert not s.pending and s.next_due(5.1) == pytest.approx(5.05 + MAX)


def test_continuous_expensive_syncs_keep_to_the_budget() -> None:
    """1,000 syncs of 50 ms of CPU each, with a change always waiting (a rollout that
    never ends): the syncs' CPU over the run is at most the budget, give or take the
    credit, and the budget is used, not wasted on extra waiting."""
    s = SyncSchedule(None, MAX, now=0.0)
    cost, now, total, waited = 0.05, 0.0, 0.0, 0
    for _ in range(1000):
        s.request()
        due = s.next_due(now)
        assert due is not None
        waited += due > now
        now = max(now, due)
        sync(s, now, cost)
        total += cost
        now += cost
    elapsed = now
    # CPU / elapsed <= 20%, give or take the credit and the last sync (it started in
    # credit): 50 s of CPU took at least 248.75 s.
    assert total <= BUDGET * elapsed + CREDIT + cost + 1e-9
    assert elapsed >= (total - CREDIT - cost) / BUDGET - 1e-9
    assert elapsed <= total / BUDGET + 1e-6  # no longer than the budget needs
    assert waited == s.held[HELD_BY_BUDGET] >= 990


def test_a_burst_within_the_credit_never_waits_then_the_debt_is_repaid() -> None:
    s = SyncSchedule(None, MAX, now=0.0)
    now = 100.0
    for _ in range(3):  # 3 x 60 ms: within 0.2 CPU-s of credit
        s.request()
        assert s.next_due(now) == now
        sync(s, now, cost=0.06)
        now += 0.06
    s.request()
    assert s.next_due(now) == now  # 0.18 spent, 0.036 repaid meanwhile: still in credit
    sync(s, now, cost=0.5)  # a big one overdraws
    now += 0.5
    s.request()
    due = s.next_due(now)
    assert due is not None and due > now
    # It waits exactly until the overdrawn CPU is repaid at 20% of a core.
    assert s.budget is not None
    assert s.budget.level(due) == pytest.approx(CREDIT)
    assert s.view(now).holding == HELD_BY_BUDGET
    assert s.start(due - 0.001) is None
    sync(s, due, cost=0.001)
    assert s.held[HELD_BY_BUDGET] == 1
    # After a quiet period the credit is whole again: the next change is immediate.
    s.request()
    assert s.next_due(due + 10) == due + 10


def test_the_first_sync_is_not_charged() -> None:
    """Programming the whole cluster at start costs seconds at 10,000 services; the first
    changes after it must not wait for that to be repaid."""
    s = SyncSchedule(None, MAX, now=0.0)
    s.request(Trigger.INITIAL)
    assert sync(s, 1.0, cost=3.0) is Trigger.INITIAL
    s.request()
    assert s.next_due(4.0) == 4.0


@pytest.mark.parametrize("trigger", [Trigger.PERIODIC, Trigger.DRIFT])
def test_full_syncs_after_the_first_are_charged(trigger: Trigger) -> None:
    s = SyncSchedule(None, MAX, now=0.0)
    s.request(trigger)
    sync(s, 1.0, cost=2.0)
    s.request()
    assert s.next_due(3.0) == pytest.approx(1.0 + (2.0 - CREDIT) / BUDGET)


def test_budget_off_never_holds_a_sync_back() -> None:
    s = SyncSchedule(None, MAX, now=0.0, cpu_budget=None)
    for i in range(5):
        s.request()
        assert sync(s, i * 0.001, cost=10.0, took=0.0) is Trigger.CHANGE
    assert s.view(1.0).cpu_budget is None and s.view(1.0).credit_cpu_seconds is None


def test_a_budget_of_a_whole_core_never_holds_a_one_thread_sync_back() -> None:
    s = SyncSchedule(None, MAX, now=0.0, cpu_budget=1.0)
    now = 0.0
    for _ in range(100):  # a sync's CPU is at most its duration: one thread at a time
        s.request()
        assert s.next_due(now) == now
        sync(s, now, cost=0.5)
        now += 0.5


def test_min_sync_period_set_is_the_token_bucket_with_the_budget_on_top() -> None:
    s = SyncSchedule(1.0, MAX, burst=2, now=0.0)
    # Cheap syncs: the token bucket alone paces, as kube-proxy's does.
    for t in (10.0, 10.01):
        s.request()
        sync(s, t, cost=0.001)
    s.request()
    assert s.next_due(10.02) == pytest.approx(11.0)
    assert s.view(10.02).holding == HELD_BY_PERIOD
    sync(s, 11.0, cost=1.0)  # an expensive one: now the budget binds, past the token
    s.request()
    due = s.next_due(12.0)
    assert due == pytest.approx(11.0 + (1.0 - CREDIT) / BUDGET)  # past the token at 12
    assert due is not None and due > 12.0
    sync(s, due, cost=0.001)
    assert s.held == {HELD_BY_PERIOD: 1, HELD_BY_BUDGET: 1}
    assert s.view(due).mode == "min-sync-period"


def test_min_sync_period_zero_leaves_only_the_budget() -> None:
    s = SyncSchedule(0.0, MAX, now=0.0)
    for i in range(10):  # cheap syncs: never held, however close together
        s.request()
        assert sync(s, i * 0.001, cost=0.0) is Trigger.CHANGE
    s.request()
    sync(s, 1.0, cost=1.2)
    s.request()
    assert s.next_due(2.2) == pytest.approx(1.0 + (1.2 - CREDIT) / BUDGET)


def test_the_view_for_the_debug_dump() -> None:
    s = SyncSchedule(None, MAX, now=0.0)
    view = s.view(0.0)
    assert (view.mode, view.min_sync_period, view.cpu_budget) == ("cost", None, BUDGET)
    assert view.credit_cpu_seconds == pytest.approx(CREDIT) and view.holding is None
    s.request()
    sync(s, 0.0, cost=0.5, took=0.0)
    assert s.view(0.0).credit_cpu_seconds == pytest.approx(CREDIT - 0.5)  # overdrawn


def test_a_budget_must_be_positive() -> None:
    with pytest.raises(ValueError):
        CpuBudget(0.0)


@settings(max_examples=200, deadline=None)
@given(
    requests=st.lists(st.floats(0, 30, allow_nan=False), min_size=1, max_size=60),
    costs=st.lists(st.sampled_from([0.0, 0.002, 0.05, 0.3, 1.5]), min_size=1, max_size=60),
    budget=st.sampled_from([0.05, 0.2, 0.5]),
)
def test_property_syncs_keep_to_the_budget_over_every_stretch(
    requests: list[float], costs: list[float], budget: float
) -> None:
    """Between any two sync starts a and b, the syncs started in [a, b) cost at most
    budget x (b - a) + credit; and every change is applied by a later sync."""
    s = SyncSchedule(None, 1e9, now=0.0, cpu_budget=budget)
    pending = sorted(requests)
    runs: list[tuple[float, float]] = []  # (start, cost)
    now = 0.0
    while pending or s.pending:
        due = s.next_due(now)
        if due is not None and s.pending and (not pending or due <= pending[0]):
            now = max(now, due)
            cost = costs[len(runs) % len(costs)]
            sync(s, now, cost)
            runs.append((now, cost))
            now += cost
            while pending and pending[0] <= now:
                pending.pop(0)
                s.request()
            continue
        now = max(now, pending.pop(0))
        s.request()
    starts = [r[0] for r in runs]
    assert starts[-1] >= max(requests)
    for i, (a, _) in enumerate(runs):
        spent = 0.0
        for j in range(i, len(runs) - 1):
            spent += runs[j][1]
            b = runs[j + 1][0]
            assert spent <= budget * (b - a) + budget * 1.0 + 1e-6
