"""What a list or watch request can run into, as the exceptions the reflector's run loop
handles (reflector.py), and the checks that raise them: an answer's status, a request's
time limit.

The classes keep their leading underscore: their names are in the reflector's log lines
and its `last_error` (docs/watch.md quotes them), and they are no API outside proxy/kube.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import orjson

from proxy.kube.client import Response, read_body

# The start of an error answer's body is all a log line needs.
ERROR_BODY_BYTES = 64 * 1024


class _Gone(Exception):
    """410 Gone: the history (or the list's snapshot) we need is compacted away."""


class _HttpError(Exception):
    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.retry_after = retry_after


class _Stalled(Exception):
    """A watch stream delivered nothing for stall_timeout."""


class _ShortWatch(Exception):
    """A watch stream ended at once, having delivered nothing."""


class _Overdue(Exception):
    """The stream outlived the timeoutSeconds we asked for, and its grace."""


class _WentBack(Exception):
    """A watch event or bookmark older than the revision we resume from."""


class _BadList(Exception):
    """A list that would not end (too large, too many pages or objects, or repeating)."""


@asynccontextmanager
async def time_limit(timer: asyncio.Timeout, late: str | Callable[[], Exception]
                     ) -> AsyncIterator[asyncio.Timeout]:
    """`async with timer`, its expiry raised as an error that says what was late:
    TimeoutError(late), or late(). A TimeoutError of the client's own (its limit is set
    later than ours, so this means something else went wrong) passes unchanged: an error
    like any other."""
    try:
        async with timer:
            yield timer
    except TimeoutError:
        if not timer.expired():
            raise
        raise (TimeoutError(late) if isinstance(late, str) else late()) from None


async def check_status(resp: Response) -> None:
    """Raise for an answer to a list or watch request that is not 200."""
    if resp.status == 410:
        # History or a continue token that is gone: list again.
        raise _Gone()
    if resp.status != 200:
        data = await read_body(resp, ERROR_BODY_BYTES, truncate=True)
        raise _HttpError(resp.status, status_message(data), retry_after(resp.headers))


def retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def status_message(data: bytes | bytearray) -> str:
    try:
        status = orjson.loads(data)
        if isinstance(status, dict) and status.get("message"):
            return str(status["message"])
    except orjson.JSONDecodeError:
        pass
    return data[:200].decode("utf-8", "replace")
