"""Polling with a deadline: the one way tests, benchmarks and the demo wait for a condition.

Never a bare sleep as synchronisation: poll `cond` until it returns something truthy and
return that, or raise `TimedOut` (an AssertionError, so a test failure reads as one) naming
what was awaited, with `detail()` appended when given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class TimedOut(AssertionError):
    """A condition did not hold before its deadline."""


def _timed_out(timeout: float, what: str, detail: Callable[[], object] | None) -> TimedOut:
    extra = f": {detail()}" if detail is not None else ""
    return TimedOut(f"timed out after {timeout:g}s waiting for {what}{extra}")


def wait(cond: Callable[[], T | None], timeout: float, what: str = "condition", *,
         interval: float = 0.05, detail: Callable[[], object] | None = None) -> T:
    """Poll `cond` until it returns a truthy value, and return that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what, detail)
        time.sleep(interval)


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
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what, detail)
        await asyncio.sleep(interval)
