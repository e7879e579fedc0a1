"""The fault table's arithmetic: failures, windows and runs counted from attempts."""

from __future__ import annotations

import os
import subprocess
import time

from proxy.netns_lab import poll
from tests.faults.traffic import Attempt, StallClock, Target, report

WEB = Target("web", "198.18.128.10", 80, "tcp", frozenset({"web-1"}))


def attempts(*outcomes: tuple[float, float, bool]) -> list[tuple[Target, Attempt]]:
    return [(WEB, Attempt(start, end, "web-1" if ok else "timeout", ok))
            for start, end, ok in outcomes]


def test_a_lone_slow_timeout_is_a_run_of_one_however_long_its_window() -> None:
    rep = report(attempts((0.0, 0.1, True), (0.2, 1.3, False), (2.4, 2.5, True)), [WEB])
    assert (rep.failed, rep.longest_run) == (1, 1)
    assert abs(rep.longest_window - 2.2) < 1e-9


def test_the_longest_run_of_failures_in_a_row() -> None:
    rep = report(attempts((0, 1, False), (1, 2, True), (2, 3, False), (3, 4, False),
                          (4, 5, False), (5, 6, True), (6, 7, False)), [WEB])
    assert (rep.failed, rep.longest_run, rep.longest_window) == (5, 3, 3)


def test_a_run_still_open_at_the_end_counts_to_the_last_attempt_s_end() -> None:
    rep = report(attempts((0, 1, True), (1, 2, False), (2, 3.5, False)), [WEB])
    assert (rep.longest_run, rep.longest_window) == (2, 2.5)


def test_attempts_outside_the_span_are_not_counted() -> None:
    rep = report(attempts((0, 1, False), (5, 6, True), (9, 10, False)), [WEB],
                 since=4, until=8)
    assert (rep.attempts, rep.failed, rep.longest_run) == (1, 0, 0)


def test_a_failure_across_a_stall_is_counted_apart_and_breaks_no_run() -> None:
    rep = report(attempts((0, 1, True), (1, 3, False), (3, 5, False), (5, 6, True)),
                 [WEB], stalls=[(3.5, 4.6)])
    assert (rep.attempts, rep.failed, rep.stalled) == (3, 1, 1)
    assert (rep.longest_run, rep.longest_window) == (1, 4)
    assert "1 more during stalls" in rep.failures()


def test_a_stall_excuses_no_success_and_no_failure_beside_it() -> None:
    rep = report(attempts((0, 1, False), (1.5, 2, True), (2.5, 3, False)), [WEB],
                 stalls=[(1.2, 2.2)])
    assert (rep.attempts, rep.failed, rep.stalled) == (3, 2, 0)


def test_the_stall_clock_records_a_stop_of_the_process() -> None:
    """The process stopped (SIGSTOP) for 0.5 s by a child, as a guest stops on a loaded
    host: the clock's thread records a span of at least that around the stop."""
    with StallClock(gap=0.3, tick=0.01) as clock:
        began = time.monotonic()
        stopper = subprocess.run(["sh", "-c", f"kill -STOP {os.getpid()}; sleep 0.5; "
                                  f"kill -CONT {os.getpid()}"], check=True, timeout=10)
        poll.wait(lambda: clock.stalls() or None, 5, "the stop recorded")
        ended = time.monotonic()
    assert stopper.returncode == 0
    assert [(b, e) for b, e in clock.stalls() if began < e and b < ended and e - b >= 0.45], \
        (began, ended, clock.stalls())
