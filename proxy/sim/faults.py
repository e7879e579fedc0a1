"""Fault injection: failing the next N API requests and adding latency.

State only; the server's middleware consults it. Watch cuts, compaction and restarts act
on the server and store directly (see `SimServer`).
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.sim.errors import ApiError, injected


@dataclass(slots=True)
class Faults:
    fail_remaining: int = 0
    fail_code: int = 500
    retry_after: int | None = None
    latency: float = 0.0
    injected_failures: int = 0  # how many requests were failed on purpose, for tests

    def fail_next(self, count: int, code: int = 500, retry_after: int | None = None) -> None:
        if code not in (429, 500, 503):
            raise ValueError(f"unsupported injected status {code}: use 429, 500 or 503")
        self.fail_remaining, self.fail_code, self.retry_after = count, code, retry_after

    def next_failure(self) -> ApiError | None:
        """The error to answer the current request with, if one is due."""
        if self.fail_remaining <= 0:
            return None
        self.fail_remaining -= 1
        self.injected_failures += 1
        return injected(self.fail_code, self.retry_after)

    def clear(self) -> None:
        self.fail_remaining, self.latency = 0, 0.0
