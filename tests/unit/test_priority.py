"""A traffic reading gives way to a change's sync (common/priority.py): at a pause it
waits while one is under way, for as long as it lasts but never past GIVE_WAY_MAX, and
goes straight on when none is; and it rests there for its share of the time."""

from __future__ import annotations

import threading
import time

import pytest

from proxy.dataplane.common import priority
from proxy.dataplane.common.priority import Priority


def test_a_pause_during_a_change_waits_up_to_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority, "GIVE_WAY_MAX", 0.05)
    p = Priority()
    with p.change():
        assert p.under_way
        began = time.monotonic()
        p.give_way()  # nothing ends the change: the bound does
        assert time.monotonic() - began >= 0.05
    assert not p.under_way


def test_a_pause_with_no_change_under_way_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority, "GIVE_WAY_MAX", 60.0)
    p = Priority()
    began = time.monotonic()
    p.give_way()
    assert time.monotonic() - began < 30  # not the bound


def test_a_waiting_reading_goes_on_once_the_change_is_synced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority, "GIVE_WAY_MAX", 60.0)
    p = Priority()
    ended: list[float] = []
    went_on: list[float] = []
    at_pause = threading.Event()

    def reading() -> None:
        at_pause.set()
        p.give_way()
        went_on.append(time.monotonic())

    with p.change():
        thread = threading.Thread(target=reading)
        thread.start()
        assert at_pause.wait(30)
        ended.append(time.monotonic())
    thread.join(30)
    assert not thread.is_alive()  # well before the 60 s bound
    assert went_on[0] >= ended[0]


class Clock:
    """priority.py's monotonic and sleep: the test moves the clock, and a sleep is
    recorded and moves it too."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.mark.parametrize(("share", "rest"), [(0.5, 0.3), (0.25, 0.9)])
def test_a_reading_rests_at_a_pause_for_its_share_of_the_time(
        monkeypatch: pytest.MonkeyPatch, share: float, rest: float) -> None:
    clock = Clock()
    monkeypatch.setattr(priority, "monotonic", clock.monotonic)
    monkeypatch.setattr(priority, "sleep", clock.sleep)
    monkeypatch.setattr(priority, "READING_SHARE", share)
    pause = Priority().reading_pauses()
    clock.now += 0.3  # worked since the reading began
    pause()
    assert sum(clock.slept) == pytest.approx(rest)
    clock.slept.clear()
    pause()  # at once: nothing worked since the last pause, no rest
    assert sum(clock.slept) == pytest.approx(0.0)
