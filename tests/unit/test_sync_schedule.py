"""The sync runner's timing (kube-proxy's BoundedFrequencyRunner), on a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.agent.schedule import SyncSchedule, Trigger

MIN, MAX = 1.0, 3600.0


def run_now(s: SyncSchedule, now: float, duration: float = 0.0) -> Trigger | None:
    trigger = s.start(now)
    if trigger is not None:
        s.finish(now + duration)
    return trigger


def test_the_first_change_after_a_quiet_period_syncs_at_once() -> None:
    s = SyncSchedule(MIN, MAX, burst=2, now=0.0)
    s.request()
    assert s.next_due(100.0) == 100.0
    assert run_now(s, 100.0) is Trigger.CHANGE


def test_burst_of_two_then_coalesced_at_min_sync_period() -> None:
    s = SyncSchedule(MIN, MAX, burst=2, now=0.0)
    s.request()
    assert run_now(s, 10.0, duration=0.01) is Trigger.CHANGE
    s.request()
    assert run_now(s, 10.02, duration=0.01) is Trigger.CHANGE  # the second token
    # Five more changes within the next 100 ms: none may run yet...
    for t in (10.04, 10.05, 10.06, 10.07, 10.1):
        s.request()
        assert s.start(t) is None
    # ...and they are applied together by ONE sync, once a token is back: one token
    # per second, counted from the first sync of the burst.
    due = s.next_due(10.1)
    assert due == pytest.approx(11.0)
    assert s.start(due - 0.001) is None
    assert run_now(s, due) is Trigger.CHANGE
    assert not s.pending
    assert s.next_due(due + 0.5) == pytest.approx(due + MAX)  # only the periodic one left


def test_burst_one_spaces_every_sync_by_min_sync_period() -> None:
    s = SyncSchedule(2.0, MAX, burst=1, now=0.0)
    s.request()
    assert run_now(s, 5.0) is Trigger.CHANGE
    s.request()
    assert s.next_due(5.5) == pytest.approx(7.0)


def test_changes_during_a_sync_give_exactly_one_follow_up() -> None:
    s = SyncSchedule(MIN, MAX, burst=1, now=0.0)
    s.request()
    assert s.start(0.0) is Trigger.CHANGE
    assert s.next_due(0.1) is None  # running: nothing else starts
    for _ in range(3):
        s.request()
    assert s.start(0.2) is None
    s.finish(0.5)
    assert s.next_due(0.6) == pytest.approx(1.0)
    assert run_now(s, 1.0) is Trigger.CHANGE
    assert not s.pending


def test_periodic_full_resync_without_changes() -> None:
    s = SyncSchedule(MIN, 60.0, burst=2, now=0.0)
    assert s.next_due(10.0) == 60.0
    assert s.start(59.9) is None
    assert run_now(s, 60.0, duration=1.0) is Trigger.PERIODIC
    assert s.next_due(61.0) == pytest.approx(121.0)  # from the end of that sync


def test_a_sync_postpones_the_periodic_one() -> None:
    s = SyncSchedule(MIN, 60.0, burst=2, now=0.0)
    s.request()
    run_now(s, 50.0)
    assert s.next_due(51.0) == pytest.approx(110.0)


def test_retry_after_a_failure_is_rate_limited_too() -> None:
    s = SyncSchedule(MIN, MAX, burst=1, now=0.0)
    s.request()
    assert s.start(0.0) is Trigger.CHANGE
    s.finish(0.1)
    s.retry_after(0.1, 0.2)  # asks for 0.3, but a token is only back at 1.0
    assert s.next_due(0.15) == pytest.approx(1.0)
    assert run_now(s, 1.0) is Trigger.RETRY
    assert s.next_due(1.2) == pytest.approx(1.0 + MAX)


def test_the_earliest_retry_wins() -> None:
    s = SyncSchedule(0.0, MAX, now=0.0)
    s.retry_after(0.0, 5.0)
    s.retry_after(0.0, 2.0)
    s.retry_after(0.0, 9.0)
    assert s.next_due(0.0) == 2.0


def test_a_change_beats_a_later_retry_and_reports_change() -> None:
    s = SyncSchedule(0.0, MAX, now=0.0)
    s.retry_after(0.0, 30.0)
    s.request()
    assert run_now(s, 1.0) is Trigger.CHANGE
    assert s.next_due(1.0) == pytest.approx(1.0 + MAX)  # the retry was absorbed


def test_zero_min_sync_period_never_waits() -> None:
    s = SyncSchedule(0.0, MAX, burst=2, now=0.0)
    for i in range(10):
        s.request()
        assert run_now(s, i * 0.001) is Trigger.CHANGE


def test_initial_trigger_is_not_overwritten_by_changes() -> None:
    s = SyncSchedule(MIN, MAX, now=0.0)
    s.request(Trigger.INITIAL)
    s.request()
    assert run_now(s, 0.0) is Trigger.INITIAL


def test_tokens_refill_after_a_quiet_period() -> None:
    s = SyncSchedule(MIN, MAX, burst=2, now=0.0)
    for t in (0.0, 0.01):
        s.request()
        assert run_now(s, t) is Trigger.CHANGE
    s.request()
    assert s.start(0.02) is None
    run_now(s, s.next_due(0.02) or 0.0)
    # Quiet for long enough to refill both tokens: two immediate syncs again.
    for t in (10.0, 10.01):
        s.request()
        assert run_now(s, t) is Trigger.CHANGE


@pytest.mark.parametrize(("lo", "hi"), [(2.0, 1.0), (-1.0, 5.0), (0.0, 0.0)])
def test_bad_intervals(lo: float, hi: float) -> None:
    with pytest.raises(ValueError):
        SyncSchedule(lo, hi)


def simulate(requests: list[float], min_interval: float, burst: int,
             duration: float) -> list[tuple[float, float, Trigger]]:
    """Drive the schedule like the runner does; returns (start, end, trigger) per sync."""
    s = SyncSchedule(min_interval, 1e9, burst=burst, now=0.0)
    pending = sorted(requests)
    runs: list[tuple[float, float, Trigger]] = []
    now = 0.0
    while pending or s.pending:
        due = s.next_due(now)
        nxt = pending[0] if pending else None
        if due is not None and (nxt is None or due <= nxt):
            now = max(now, due)
            trigger = s.start(now)
            assert trigger is not None
            s.finish(now + duration)
            runs.append((now, now + duration, trigger))
            now += duration
            # Requests that arrived while it ran are seen when it ends.
            while pending and pending[0] <= now:
                pending.pop(0)
                s.request()
            continue
        assert nxt is not None
        now = max(now, nxt)
        pending.pop(0)
        s.request()
    return runs


@settings(max_examples=300, deadline=None)
@given(
    requests=st.lists(st.floats(0, 20, allow_nan=False), min_size=1, max_size=40),
    min_interval=st.sampled_from([0.0, 0.25, 1.0, 2.0]),
    burst=st.integers(1, 3),
    duration=st.sampled_from([0.0, 0.01, 0.5]),
)
def test_property_rate_bounded_and_no_change_left_behind(
    requests: list[float], min_interval: float, burst: int, duration: float
) -> None:
    runs = simulate(requests, min_interval, burst, duration)
    starts = [r[0] for r in runs]
    # Every change is applied by a sync that starts at or after it arrives.
    last_request = max(requests)
    assert starts and starts[-1] >= last_request
    # Never more syncs in a window than the token bucket allows.
    if min_interval > 0:
        for i, a in enumerate(starts):
            for j in range(i, len(starts)):
                window = starts[j] - a
                assert j - i + 1 <= burst + window / min_interval + 1e-9
    # Coalescing: no more syncs than changes, and none of them is idle.
    assert len(runs) <= len(requests)
    # Bounded delay: a change waits at most min_interval + one sync's duration beyond
    # what the rate limit needs (here: the sync running when it came, then a token).
    for t in requests:
        first_after = min(s for s in starts if s >= t)
        assert first_after - t <= max(min_interval, 0) * burst + 2 * duration + 1e-9
