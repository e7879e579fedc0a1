"""When to sync: kube-proxy's BoundedFrequencyRunner timing as a pure state machine.

Semantics (upstream `pkg/util/async/bounded_frequency_runner.go`, with kube-proxy's
`burstSyncs` of 2):
- a change requests a sync; it runs at once if the rate limiter has a token (a token
  bucket of `burst` tokens refilled at one per `min_interval`), so the first change after
  a quiet period is applied immediately;
- otherwise it runs as soon as a token is back; every request made meanwhile is
  coalesced into that one sync;
- with no change at all a sync still runs every `max_interval` (our full resync);
- after a failed sync, a retry is due after a delay (the runner's backoff).

Time is passed in by the caller (seconds on a monotonic clock), so the rules are tested
without sleeping. The async loop around it lives in `sync_loop.py`.
"""

from __future__ import annotations

import enum


class Trigger(enum.Enum):
    INITIAL = "initial"  # the first sync, once every watched resource has listed
    CHANGE = "change"  # something in the cluster changed
    PERIODIC = "periodic"  # --sync-period passed without a sync
    RETRY = "retry"  # the previous sync failed
    DRIFT = "drift"  # another process changed our rules: rewrite them all


class SyncSchedule:
    def __init__(self, min_interval: float, max_interval: float, burst: int = 2,
                 now: float = 0.0) -> None:
        if min_interval < 0 or max_interval <= 0:
            raise ValueError("intervals must be positive")
        if max_interval < min_interval:
            raise ValueError(f"max_interval ({max_interval}) < min_interval ({min_interval})")
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.burst = max(1, burst)
        self._tokens = float(self.burst)
        self._refilled_at = now
        self._pending: Trigger | None = None
        self._periodic_at = now + max_interval
        self._retry_at: float | None = None
        self.running = False

    # --- inputs ----------------------------------------------------------------------

    def request(self, trigger: Trigger = Trigger.CHANGE) -> None:
        """Ask for a sync as soon as the rate limit allows (coalesced with others)."""
        if self._pending is not Trigger.INITIAL:
            self._pending = trigger

    def retry_after(self, now: float, delay: float) -> None:
        at = now + delay
        if self._retry_at is None or at < self._retry_at:
            self._retry_at = at

    # --- decisions -------------------------------------------------------------------

    def _tokens_at(self, now: float) -> float:
        if self.min_interval == 0:
            return float(self.burst)
        return min(float(self.burst),
                   self._tokens + (now - self._refilled_at) / self.min_interval)

    def _earliest_allowed(self, now: float) -> float:
        """When the rate limiter next allows a run (now, if it does already). The token
        bucket alone decides, as upstream's `TryAccept`; upstream also re-arms its timer
        for `min_interval` after the last run *ended*, a hint that only delays the check
        when no other request comes, which we do not copy."""
        if self._tokens_at(now) >= 1.0:
            return now
        return self._refilled_at + (1.0 - self._tokens) * self.min_interval

    def next_due(self, now: float) -> float | None:
        """Absolute time of the next sync (<= now: due), None while one is running."""
        if self.running:
            return None
        wanted = self._periodic_at
        if self._pending is not None:
            wanted = min(wanted, now)
        if self._retry_at is not None:
            wanted = min(wanted, self._retry_at)
        return max(wanted, self._earliest_allowed(now))

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
        self.running = True
        return trigger

    def finish(self, now: float) -> None:
        """The sync that `start` began is over (successfully or not)."""
        self.running = False
        self._periodic_at = now + self.max_interval

    @property
    def pending(self) -> bool:
        return self._pending is not None
