"""Traffic that never stops while faults are injected: fresh connections, counted.

One thread per target opens a fresh connection (TCP) or sends a fresh datagram (UDP,
fresh source port) every `interval` seconds from the client namespace, and records when
it started, what answered and whether that was acceptable (a backend the target allows).
`Report` turns the record into what the fault table shows: attempts, failures and the
longest failure window (from the first failed attempt of a run of failures to the next
success) and the longest run of failures in a row. Every loop is bounded in time
(`limit`) and stops on `stop()`.

`UdpFlows` is the other kind of client: long-lived UDP flows, each one socket (one source
port, one conntrack entry) asked again and again, each datagram recorded with who
answered it, so that a test can say which flow moved to another backend and how many
datagrams went unanswered (`pinned_flows` opens them, so many per backend).

`Laps` says when each step of a scenario ended, so that a failure `Report.failed_at`
places can be put beside the step that caused it.

`StallClock` says when the process running the clients was not run at all (an emulated
machine on a loaded host): a failure that spans such a stop is counted apart
(`TargetReport.stalled`), as it says nothing about the rules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from proxy.agent.logs import log_stamp
from proxy.netns_lab import poll, probe


class Laps:
    """Where a timed change spent its time, step by step, for the report: each step's
    length and when it ended, in seconds since `started` (a step that waits on a kubelet
    or a controller can take seconds or a minute)."""

    def __init__(self, started: float | None = None) -> None:
        self.started = self._last = time.monotonic() if started is None else started
        self.laps: list[str] = []

    def __call__(self, step: str) -> None:
        now = time.monotonic()
        self.laps.append(f"{step} {now - self._last:.1f}s (at {now - self.started:.1f}s)")
        self._last = now

    @property
    def took(self) -> float:
        return self._last - self.started

    def __str__(self) -> str:
        return ", ".join(self.laps)


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
    longest_run: int = 0  # the most failures in a row
    answers: dict[str, int] = field(default_factory=dict)
    failed_at: list[float] = field(default_factory=list)  # failures' starts, from `since`
    stalled: int = 0  # failures that spanned a stall of the clients' machine (not in failed)


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
    def stalled(self) -> int:
        return sum(t.stalled for t in self.targets)

    @property
    def longest_window(self) -> float:
        return max((t.longest_window for t in self.targets), default=0.0)

    @property
    def longest_run(self) -> int:
        return max((t.longest_run for t in self.targets), default=0)

    def failures(self) -> str:
        """The targets that failed and how, for an assertion message: when each failed
        attempt started, in seconds from `since` and as the agent's log stamps its lines
        (the time of day, UTC), to read the log beside it."""
        epoch = time.time() - time.monotonic()  # attempts are stamped by time.monotonic()

        def at(s: float) -> str:
            return f"{s:.2f} s ({log_stamp(epoch + self.since + s)[11:]})"

        return "; ".join(f"{t.target}: {t.failed}/{t.attempts} failed, answers {t.answers}, "
                         f"at {', '.join(at(s) for s in t.failed_at[:10])}"
                         + (f" ({t.stalled} more during stalls)" if t.stalled else "")
                         for t in self.targets if t.failed) or "none"


def report(attempts: Iterable[tuple[Target, Attempt]], targets: Sequence[Target],
           since: float = 0.0, until: float = float("inf"),
           stalls: Sequence[tuple[float, float]] = ()) -> Report:
    """The attempts started in [since, until), target by target. A failed attempt that
    spans one of `stalls` (monotonic spans when the clients were not run) is counted in
    `stalled` only: neither a failure nor part of a run or a window."""
    by_target = {t: TargetReport(t) for t in targets}
    runs: dict[Target, float | None] = dict.fromkeys(targets)
    in_a_row: dict[Target, int] = dict.fromkeys(targets, 0)
    last_end: dict[Target, float] = {}
    for target, a in attempts:
        if not since <= a.started < until:
            continue
        rep = by_target[target]
        if not a.ok and any(a.started < end and begin < a.ended for begin, end in stalls):
            rep.stalled += 1
            continue
        rep.attempts += 1
        rep.answers[a.answer] = rep.answers.get(a.answer, 0) + 1
        last_end[target] = a.ended
        in_a_row[target] = 0 if a.ok else in_a_row[target] + 1
        rep.longest_run = max(rep.longest_run, in_a_row[target])
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
               targets: Sequence[Target] | None = None,
               stalls: Sequence[tuple[float, float]] = ()) -> Report:
        return report(self.attempts(), targets or self.targets, since, until, stalls)


class StallClock:
    """When this process went unrun for `gap` seconds or more: a thread asks to wake
    every `tick` seconds and records each wake that came that late, as the monotonic
    span it slept. An emulated machine whose host is loaded (the real-node tier beside
    the kernel tier in CI) can stop for seconds; the clients' threads stop with it."""

    def __init__(self, gap: float, tick: float = 0.02, limit: float = 600.0) -> None:
        self.gap, self.tick, self.limit = gap, tick, limit
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stalls: list[tuple[float, float]] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name="stall clock")

    def __enter__(self) -> StallClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.tick + 5)

    def _run(self) -> None:
        end = time.monotonic() + self.limit
        last = time.monotonic()
        while not self._stop.wait(self.tick) and last < end:
            now = time.monotonic()
            if now - last >= self.gap:
                with self._lock:
                    self._stalls.append((last, now))
            last = now

    def stalls(self) -> list[tuple[float, float]]:
        with self._lock:
            return list(self._stalls)


# --- long-lived UDP flows ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Datagram:
    sent: float  # monotonic
    ended: float  # the answer came, or the wait for it ended
    answer: str | None  # the backend that answered; None: no answer within the timeout


@dataclass
class FlowLog:
    """One long-lived flow's datagrams; `pinned` is the backend it had when it began."""

    name: str
    pinned: str | None
    datagrams: list[Datagram] = field(default_factory=list)

    def answers(self, since: float = 0.0) -> dict[str, int]:
        """How many datagrams sent since `since` each backend answered ("none": not
        answered)."""
        out: dict[str, int] = {}
        for d in self.datagrams:
            if d.sent >= since:
                key = d.answer or "none"
                out[key] = out.get(key, 0) + 1
        return out

    @property
    def unanswered(self) -> int:
        return sum(1 for d in self.datagrams if d.answer is None)

    @property
    def moved(self) -> bool:
        """Answered by a backend other than the one it had (any backend, if it had none)."""
        return any(d.answer not in (None, self.pinned) for d in self.datagrams)

    def first_answer(self, since: float, by: str | None = None) -> float | None:
        """When the first datagram sent at or after `since` was answered (by `by`, when
        given)."""
        return next((d.ended for d in self.datagrams if d.sent >= since and d.answer
                     and by in (None, d.answer)), None)

    def longest_silence(self) -> float:
        """The longest time from an unanswered datagram to the next answer (or to the
        end of the log)."""
        longest, began = 0.0, None
        for d in self.datagrams:
            if d.answer is None:
                began = d.sent if began is None else began
            elif began is not None:
                longest, began = max(longest, d.ended - began), None
        if began is not None:
            longest = max(longest, self.datagrams[-1].ended - began)
        return longest

    def __str__(self) -> str:
        return f"{self.name} (had {self.pinned}): {self.answers()}"


def pinned_flows(ns: str, ip: str, port: int, per_backend: dict[str, int],
                 timeout: float = 1.0, tries: int = 64) -> list[tuple[probe.UdpFlow, str]]:
    """Long-lived UDP flows from namespace `ns`, `per_backend[name]` of them answered
    by each backend (each flow's first datagram picks its backend, as the rules balance
    it; flows that land where enough already are get closed). At most `tries` sockets."""
    want = dict(per_backend)
    got: list[tuple[probe.UdpFlow, str]] = []
    for _ in range(tries):
        if not any(want.values()):
            return got
        flow = probe.UdpFlow(ns, ip, port, timeout)
        answer = flow.ask()
        if answer is not None and want.get(answer, 0) > 0:
            want[answer] -= 1
            got.append((flow, answer))
        else:
            flow.close()
    for flow, _ in got:
        flow.close()
    raise AssertionError(f"{ip}:{port}/udp: {tries} flows did not give {per_backend} "
                         f"(still wanted {want})")


class UdpFlows:
    """Long-lived UDP flows kept busy in the background, one thread each: a datagram,
    its answer (or the timeout), then `interval` seconds' pause; bounded by `limit`
    seconds and `most` datagrams per flow. The flows are closed on exit."""

    def __init__(self, flows: Sequence[tuple[probe.UdpFlow, str | None]], *,
                 interval: float = 0.075, limit: float = 600.0, most: int = 10000) -> None:
        self.interval, self.limit, self.most = interval, limit, most
        self._flows = [flow for flow, _ in flows]
        self._logs = [FlowLog(f"flow-{i + 1}", pinned) for i, (_, pinned) in enumerate(flows)]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True,
                                          name=f"udp {log.name}")
                         for i, log in enumerate(self._logs)]

    def __enter__(self) -> UdpFlows:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> UdpFlows:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop every flow and close its socket."""
        self._stop.set()
        for thread, flow in zip(self._threads, self._flows, strict=True):
            thread.join(flow.timeout + 5)
            flow.close()

    def _run(self, i: int) -> None:
        flow, log = self._flows[i], self._logs[i]
        end = time.monotonic() + self.limit
        for _ in range(self.most):
            if self._stop.is_set() or time.monotonic() > end:
                return
            sent = time.monotonic()
            answer = flow.ask()
            with self._lock:
                log.datagrams.append(Datagram(sent, time.monotonic(), answer))
            self._stop.wait(self.interval)  # pacing, not synchronisation

    def logs(self) -> list[FlowLog]:
        """A copy of every flow's log so far."""
        with self._lock:
            return [FlowLog(g.name, g.pinned, list(g.datagrams)) for g in self._logs]

    def more(self, count: int, timeout: float | None = None) -> None:
        """Return once every flow has sent `count` more datagrams, answered or not (by
        default within the time they take if none is answered, and 10 s more)."""
        if timeout is None:
            timeout = 10 + count * (self.interval + max(f.timeout for f in self._flows))
        with self._lock:
            want = [len(g.datagrams) + count for g in self._logs]

        def done() -> bool:
            assert all(t.is_alive() for t in self._threads), "a flow's thread ended early"
            with self._lock:
                return all(len(g.datagrams) >= n for g, n in zip(self._logs, want,
                                                                   strict=True))

        poll.wait(done, timeout, f"{count} more datagrams on every UDP flow")

    def until(self, cond: Callable[[list[FlowLog]], bool], timeout: float,
              what: str) -> float:
        """Wait until `cond(logs())` holds; returns when it did (monotonic)."""
        poll.wait(lambda: cond(self.logs()), timeout, what,
                  detail=lambda: "; ".join(map(str, self.logs())))
        return time.monotonic()
