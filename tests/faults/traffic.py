"""Traffic that never stops while faults are injected: fresh connections, counted.

One thread per target opens a fresh connection (TCP) or sends a fresh datagram (UDP,
fresh source port) every `interval` seconds from the client namespace, and records when
it started, what answered and whether that was acceptable (a backend the target allows).
`Report` turns the record into what the fault table shows: attempts, failures and the
longest failure window (from the first failed attempt of a run of failures to the next
success). Every loop is bounded in time (`limit`) and stops on `stop()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from proxy.lab import probe


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    ip: str
    port: int
    proto: str  # "tcp" or "udp"
    allowed: frozenset[str]  # backends whose answer counts as success

    def __str__(self) -> str:
        return f"{self.name} {self.ip}:{self.port}/{self.proto}"


@dataclass(frozen=True, slots=True)
class Attempt:
    started: float  # monotonic
    ended: float
    answer: str  # a backend's name or a failure kind (probe.REFUSED, TIMEOUT, ...)
    ok: bool


@dataclass
class TargetReport:
    target: Target
    attempts: int = 0
    failed: int = 0
    longest_window: float = 0.0  # seconds
    answers: dict[str, int] = field(default_factory=dict)
    failed_at: list[float] = field(default_factory=list)  # failures' starts, from `since`


@dataclass
class Report:
    targets: list[TargetReport]
    since: float = 0.0

    @property
    def attempts(self) -> int:
        return sum(t.attempts for t in self.targets)

    @property
    def failed(self) -> int:
        return sum(t.failed for t in self.targets)

    @property
    def longest_window(self) -> float:
        return max((t.longest_window for t in self.targets), default=0.0)

    def failures(self) -> str:
        """The targets that failed and how, for an assertion message."""
        return "; ".join(f"{t.target}: {t.failed}/{t.attempts} failed, answers {t.answers}, "
                         f"at {', '.join(f'{s:.2f}' for s in t.failed_at[:10])} s"
                         for t in self.targets if t.failed) or "none"


def report(attempts: Iterable[tuple[Target, Attempt]], targets: Sequence[Target],
           since: float = 0.0, until: float = float("inf")) -> Report:
    """The attempts started in [since, until), target by target."""
    by_target = {t: TargetReport(t) for t in targets}
    runs: dict[Target, float | None] = dict.fromkeys(targets)
    last_end: dict[Target, float] = {}
    for target, a in attempts:
        if not since <= a.started < until:
            continue
        rep = by_target[target]
        rep.attempts += 1
        rep.answers[a.answer] = rep.answers.get(a.answer, 0) + 1
        last_end[target] = a.ended
        if a.ok:
            began = runs[target]
            if began is not None:
                rep.longest_window = max(rep.longest_window, a.started - began)
                runs[target] = None
        else:
            rep.failed += 1
            rep.failed_at.append(a.started - since)
            if runs[target] is None:
                runs[target] = a.started
    for target, began in runs.items():  # a run of failures still open at the end
        if began is not None:
            rep = by_target[target]
            rep.longest_window = max(rep.longest_window, last_end[target] - began)
    return Report(list(by_target.values()), since)


class Traffic:
    """Background clients in namespace `ns`, one thread per target."""

    def __init__(self, ns: str, targets: Sequence[Target], *, interval: float = 0.05,
                 timeout: float = 0.5, limit: float = 600.0) -> None:
        self.ns, self.targets = ns, list(targets)
        self.interval, self.timeout, self.limit = interval, timeout, limit
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._attempts: list[tuple[Target, Attempt]] = []
        self._threads = [threading.Thread(target=self._run, args=(t,), daemon=True,
                                          name=f"traffic {t}") for t in self.targets]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout + 5)

    def _run(self, target: Target) -> None:
        end = time.monotonic() + self.limit
        while not self._stop.is_set() and time.monotonic() < end:
            started = time.monotonic()
            answer = probe.ask_once(self.ns, target.ip, target.port, target.proto,
                                    self.timeout)
            attempt = Attempt(started, time.monotonic(), answer, answer in target.allowed)
            with self._lock:
                self._attempts.append((target, attempt))
            self._stop.wait(self.interval)  # pacing, not synchronisation

    def attempts(self) -> list[tuple[Target, Attempt]]:
        with self._lock:
            return list(self._attempts)

    def report(self, since: float = 0.0, until: float = float("inf"),
               targets: Sequence[Target] | None = None) -> Report:
        return report(self.attempts(), targets or self.targets, since, until)
