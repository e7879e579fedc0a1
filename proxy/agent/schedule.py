"""When to sync: a pure state machine, paced by what syncs cost rather than by a clock.

Two limits decide when a requested sync may start; the later one wins.

The CPU budget (`--sync-cpu-budget`, default 20% of one core), always on unless `off`:
a leaky bucket of CPU-seconds. Every sync's cost (the CPU its own threads and the tools
it ran used, metered by sync_loop.py and given to `finish`) is poured in, dated from
the sync's start, as the CPU was spent while it ran; the bucket drains at `budget`
CPU-seconds per second of wall time. A sync may start while the bucket holds no more
than `budget x window` (the credit: 0.2 CPU-s with the defaults).
So an isolated change never waits (a sync costs milliseconds, far below the credit),
a burst runs back to back until the credit is spent, and from then on each sync waits
until what it overdrew is repaid. Over any run of length T the syncs' CPU is at most
`budget x T + credit + the last sync's cost`: a 10,000-endpoint rollout or 1,000
services created at once is applied in fewer, larger syncs instead of starving the node.
Why not a window of recent syncs (a moving average)? A bucket needs no history, gives
the exact time the next sync may start, and bounds every interval, not only the
window's. The first sync (`INITIAL`) is not charged: programming the whole cluster at
start is not churn, and charging it would make the first changes after a start at
10,000 services wait some 15 s; its CPU is still counted in the metrics. Every other
sync is charged what the caller gives: sync_loop.py gives the hourly full resync no
cost (upkeep, not churn: charged, it would hold the next changes for seconds), and
changes, retries and repairs their CPU.

The minimum period (`--min-sync-period`), only when set: kube-proxy's
BoundedFrequencyRunner (`pkg/util/async/bounded_frequency_runner.go`, kube-proxy's
`burstSyncs` of 2): a token bucket of `burst` tokens refilled at one per
`min_interval`; the first change after a quiet period runs at once, later ones wait
for a token, and every request made meanwhile is coalesced into that one sync. Set to
0, it never limits (only the budget does). Unset (the default), it does not exist.

Always: a sync never starts while one runs, so changes that arrive during a sync are
coalesced into one sync, which starts the moment that one ends (if the limits allow);
with no change a sync still runs every `max_interval` (our full resync); after a failed
sync a retry is due after a delay (the runner's backoff).

Time is passed in by the caller (seconds on a monotonic clock) and so are costs, so the
rules are tested without sleeping or burning CPU. The async loop is `sync_loop.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

DEFAULT_CPU_BUDGET = 0.2  # of one core
CREDIT_WINDOW = 1.0  # seconds of budget a burst may spend at once
_SLACK = 1e-9  # float rounding: a bucket repaid "at" its time is repaid

HELD_BY_BUDGET = "cpu-budget"
HELD_BY_PERIOD = "min-sync-period"


class Trigger(enum.Enum):
    INITIAL = "initial"  # the first sync, once every watched resource has listed
    CHANGE = "change"  # something in the cluster changed
    PERIODIC = "periodic"  # --sync-period passed without a sync
    RETRY = "retry"  # the previous sync failed
    DRIFT = "drift"  # another process changed our rules: rewrite them all


class CpuBudget:
    """The leaky bucket of sync CPU (see the module's docstring)."""

    def __init__(self, share: float, window: float = CREDIT_WINDOW, now: float = 0.0) -> None:
        if share <= 0:
            raise ValueError(f"cpu budget must be more than 0, got {share}")
        self.share = share
        self.credit = share * window
        self._level = 0.0  # CPU-seconds poured in and not yet drained
        self._at = now

    def level(self, now: float) -> float:
        return max(0.0, self._level - (now - self._at) * self.share)

    def charge(self, since: float, cpu_seconds: float) -> None:
        """Pour in what a sync that started at `since` cost. Dated from its start, so
        the bucket drained while it ran (a one-thread sync can never overdraw a budget
        of a whole core); `since` is never before the previous charge's."""
        self._level = self.level(since) + max(0.0, cpu_seconds)
        self._at = since

    def ready_at(self, now: float) -> float:
        """When a sync may start: now, or once the overdrawn part has drained."""
        over = self.level(now) - self.credit
        return now if over <= _SLACK else now + over / self.share


@dataclass(frozen=True, slots=True)
class PacingView:
    """The schedule's state, for /debug/dump."""

    mode: str  # "cost", or "min-sync-period" when that is set
    min_sync_period: float | None
    burst: int
    cpu_budget: float | None
    credit_cpu_seconds: float | None  # the budget's credit left; negative: overdrawn
    holding: str | None  # the limit holding a requested sync back now, if any
    held: dict[str, int]  # syncs started late, by the limit that held them


class SyncSchedule:
    def __init__(self, min_interval: float | None, max_interval: float, burst: int = 2,
                 now: float = 0.0, cpu_budget: float | None = DEFAULT_CPU_BUDGET) -> None:
        if (min_interval is not None and min_interval < 0) or max_interval <= 0:
            raise ValueError("intervals must be positive")
        if min_interval is not None and max_interval < min_interval:
            raise ValueError(f"max_interval ({max_interval}) < min_interval ({min_interval})")
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.burst = max(1, burst)
        self.budget = CpuBudget(cpu_budget, now=now) if cpu_budget is not None else None
        self._tokens = float(self.burst)
        self._refilled_at = now
        self._pending: Trigger | None = None
        self._periodic_at = now + max_interval
        self._retry_at: float | None = None
        self._running: Trigger | None = None
        self._started_at = now
        self._holding: str | None = None  # what held back the sync now wanted
        self.held_by: str | None = None  # what held back the sync `start` last began
        self.held = {HELD_BY_BUDGET: 0, HELD_BY_PERIOD: 0}
        self.running = False

    # --- inputs ----------------------------------------------------------------------

    def request(self, trigger: Trigger = Trigger.CHANGE) -> None:
        """Ask for a sync as soon as the limits allow (coalesced with others)."""
        if self._pending is not Trigger.INITIAL:
            self._pending = trigger

    def retry_after(self, now: float, delay: float) -> None:
        at = now + delay
        if self._retry_at is None or at < self._retry_at:
            self._retry_at = at

    # --- decisions -------------------------------------------------------------------

    def _tokens_at(self, now: float) -> float:
        if not self.min_interval:
            return float(self.burst)
        return min(float(self.burst),
                   self._tokens + (now - self._refilled_at) / self.min_interval)

    def _token_at(self, now: float) -> float:
        """When the token bucket next allows a run (now, if it does already). The bucket
        alone decides, as upstream's `TryAccept`; upstream also re-arms its timer for
        `min_interval` after the last run *ended*, a hint that only delays the check
        when no other request comes, which we do not copy."""
        if self._tokens_at(now) >= 1.0 or not self.min_interval:
            return now
        return self._refilled_at + (1.0 - self._tokens) * self.min_interval

    def _earliest_allowed(self, now: float) -> tuple[float, str | None]:
        """When the limits next allow a run, and which one binds (None: none does)."""
        token = self._token_at(now)
        cpu = self.budget.ready_at(now) if self.budget is not None else now
        if max(token, cpu) <= now:
            return now, None
        if cpu > token:
            return cpu, HELD_BY_BUDGET
        return token, HELD_BY_PERIOD

    def next_due(self, now: float) -> float | None:
        """Absolute time of the next sync (<= now: due), None while one is running.
        Also notes which limit holds back a sync that is wanted now (for `held_by`)."""
        if self.running:
            return None
        wanted = self._periodic_at
        if self._pending is not None:
            wanted = min(wanted, now)
        if self._retry_at is not None:
            wanted = min(wanted, self._retry_at)
        allowed, limit = self._earliest_allowed(now)
        if wanted <= now and limit is not None:
            self._holding = limit
        return max(wanted, allowed)

    def start(self, now: float) -> Trigger | None:
        """Begin a sync if one is due: takes a token and returns why it runs."""
        due = self.next_due(now)
        if due is None or due > now:
            return None
        if self._pending is not None:
            trigger = self._pending
        elif self._retry_at is not None and self._retry_at <= now:
            trigger = Trigger.RETRY
        else:
            trigger = Trigger.PERIODIC
        self._tokens = self._tokens_at(now) - 1.0
        self._refilled_at = now
        self._pending = None
        self._retry_at = None
        self.held_by, self._holding = self._holding, None
        if self.held_by is not None:
            self.held[self.held_by] += 1
        self.running = True
        self._running, self._started_at = trigger, now
        return trigger

    def finish(self, now: float, cpu_seconds: float = 0.0) -> None:
        """The sync that `start` began is over (successfully or not); it cost
        `cpu_seconds` of CPU, charged to the budget unless it was the first sync."""
        if self.budget is not None and self._running is not Trigger.INITIAL:
            self.budget.charge(self._started_at, cpu_seconds)
        self.running = False
        self._running = None
        self._periodic_at = now + self.max_interval

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def view(self, now: float) -> PacingView:
        budget = self.budget
        return PacingView(
            mode="cost" if self.min_interval is None else "min-sync-period",
            min_sync_period=self.min_interval, burst=self.burst,
            cpu_budget=budget.share if budget is not None else None,
            credit_cpu_seconds=(budget.credit - budget.level(now)
                                if budget is not None else None),
            holding=self._holding if (self.pending or self._retry_at is not None) else None,
            held=dict(self.held))
