"""Polling with a deadline: the one way tests, benchmarks and the demo wait for a condition.

Never a bare sleep as synchronisation: poll `cond` until it returns something truthy and
return that, or raise `TimedOut` (an AssertionError, so a test failure reads as one) naming
what was awaited, with `detail()` appended when given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar, cast

T = TypeVar("T")


class TimedOut(AssertionError):
    """A condition did not hold before its deadline."""


class _Deadline:
    """One wait's deadline: `met(value)` says whether the polled value ends the wait,
    and raises TimedOut once the deadline has passed without it."""

    def __init__(self, timeout: float, what: str, detail: Callable[[], object] | None) -> None:
        self.timeout, self.what, self.detail = timeout, what, detail
        self.at = time.monotonic() + timeout

    def met(self, value: object) -> bool:
        if value:
            return True
        if time.monotonic() > self.at:
            extra = f": {self.detail()}" if self.detail is not None else ""
            raise TimedOut(f"timed out after {self.timeout:g}s waiting for {self.what}{extra}")
        return False


def wait(cond: Callable[[], T | None], timeout: float, what: str = "condition", *,
         interval: float = 0.05, detail: Callable[[], object] | None = None) -> T:
    """Poll `cond` until it returns a truthy value, and return that value."""
    deadline = _Deadline(timeout, what, detail)
    while not deadline.met(value := cond()):
        time.sleep(interval)
    return cast(T, value)


def waited(cond: Callable[[], object], timeout: float, what: str = "condition", *,
           interval: float = 0.05, detail: Callable[[], object] | None = None) -> float:
    """`wait`, returning the seconds it took (for figures a test reports)."""
    started = time.monotonic()
    wait(cond, timeout, what, interval=interval, detail=detail)
    return time.monotonic() - started


async def eventually(cond: Callable[[], T | None], timeout: float, what: str = "condition", *,
                     interval: float = 0.05,
                     detail: Callable[[], object] | None = None) -> T:
    """`wait` on the event loop: the loop keeps running while the condition is polled."""
    deadline = _Deadline(timeout, what, detail)
    while not deadline.met(value := cond()):
        await asyncio.sleep(interval)
    return cast(T, value)
