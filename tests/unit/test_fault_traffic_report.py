"""The fault table's arithmetic: failures, windows and runs counted from attempts."""

from __future__ import annotations

from tests.faults.traffic import Attempt, Target, report

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
