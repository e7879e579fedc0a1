"""Exponential backoff with jitter, for the reflector's retries (reflector.py)."""

from __future__ import annotations

import random


class Backoff:
    """Exponential backoff, jittered: the n-th delay in a row is drawn uniformly from
    [c/2, c] with c = min(maximum, initial * 2**n); reset after a success.

    The reflector's cap, 8 s (ReflectorOptions.backoff_max), is chosen by the numbers
    (docs/watch.md has the reasoning at length):

    * recovery: a change written as an API server comes back reaches the reflector at
      most one cap (8 s) plus one round trip later — the worst case is an attempt that
      failed just before the return, followed by a full-cap delay. With client-go's 30 s
      cap that is up to 30 s (its jitter makes it [30, 60) s): a 20 s outage easily
      reaches the cap (0.5+1+2+4 s of delays before the 5th retry), so the goal of 10 s
      from return to kernel needs a cap under 10 s less a sync.
    * load: every agent runs 3 reflectors (Services, EndpointSlices or Endpoints, its
      Node), so 5,000 nodes are 15,000 reflectors. At the cap each retries once per
      [4, 8] s: 2,500 requests/s on average (at most 3,750/s, every delay at its floor)
      while the server is away; at 30 s it was 667/s (1,000/s), client-go's about 333/s.
      Away means refused connections, which cost a server that is down nothing. On its
      return every reflector must come back once whatever the policy: within 10 s that
      is at least 1,500 requests/s; with the 8 s cap the 15,000 watch resumptions arrive
      spread over 8 s (about 1,900/s), no more than any policy meeting the goal.
    * a server that is up but overloaded says so: 429 with Retry-After (API Priority
      and Fairness), which is honoured as a floor (`at_least`).

    A shared per-agent probe (one reflector retrying while the other two wait) would
    cut the rate while the server is away by 3, but not the burst on its return, which
    is the load that matters; not worth the coupling between reflectors.
    """

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        if not 0 < initial <= maximum:
            raise ValueError(f"backoff needs 0 < initial <= maximum, not {initial}, {maximum}")
        self.initial, self.maximum = initial, maximum
        self._attempt = 0
        self._rng = rng or random.Random()

    def next(self, at_least: float = 0.0) -> float:
        ceiling = self.ceiling
        # Counting stops at the cap: 0.5 * 2**1024 is no float, so after 1,024 failures
        # in a row (a 2-hour outage) this raised OverflowError, in the reflector's error
        # handler, and ended its task for good.
        if ceiling < self.maximum:
            self._attempt += 1
        return max(at_least, self._rng.uniform(ceiling / 2, ceiling))

    @property
    def ceiling(self) -> float:
        """The most the next delay can be (Retry-After aside)."""
        return min(self.maximum, self.initial * 2.0 ** min(self._attempt, 1000))

    def reset(self) -> None:
        self._attempt = 0
