"""One watch request's stream: its answer within the request timeout, then its JSON lines
decoded into events, until the server ends it, it goes quiet (`_Stalled`) or it outlives
its deadline (`_Overdue`). What the events mean for the objects we know is the
reflector's business (reflector.py).

A line longer than `max_line_bytes` is dropped as it streams by (never held whole) and
reported as soon as it crosses the bound (a line that never ends is still told): no real
API server sends objects that big (etcd refuses them), so it comes from a broken or
hostile server.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.kube.client import Api, Response
from proxy.kube.request_errors import (
    _Gone,
    _HttpError,
    _Overdue,
    _Stalled,
    check_status,
    time_limit,
)
from proxy.kube.resources import Resource

# Lines handled between yields to the event loop: a stream arriving faster than we handle
# it keeps the socket's buffer full, and reads that find data never yield.
YIELD_EVERY = 100
# How much of an oversized line is kept to name its object.
_HEAD = 4096
_NAME = re.compile(rb'"name":"([^"]{1,253})"')
_NAMESPACE = re.compile(rb'"namespace":"([^"]{1,63})"')
EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK")


@dataclass(slots=True)
class StreamTally:
    """What one watch stream delivered, for the log lines about it."""

    lines: int = 0
    events: int = 0
    bookmarks: int = 0
    oversized: int = 0
    heard: bool = False  # any bytes in time: the server is talking


async def open_watch(api: Api, resource: Resource, query: Mapping[str, str],
                     request_timeout: float, client_timeout: float) -> Response:
    """The answer to a watch request, within `request_timeout` like any other request's
    (the stream itself is ended later, by its deadline; `client_timeout`, the client's
    own limit, is later still, so that ours are the ones that fire). Raises _Gone or
    _HttpError for anything but 200."""
    timer = asyncio.timeout(request_timeout)
    async with time_limit(timer, f"no answer within {request_timeout:g}s"):
        resp = await api.get(resource.path, query, client_timeout)
    try:
        await check_status(resp)
    except BaseException:
        resp.close()
        raise
    return resp


class WatchStream:
    """The events of one open watch: (type, object) pairs, ERROR events raised as
    _Gone or _HttpError. `on_oversized(head, nth)` hears of every line over
    `max_line_bytes` (its start, to name the object, and how many the stream has had);
    `tally` counts what the stream delivered."""

    def __init__(self, resp: Response, deadline: float, stall_timeout: float,
                 max_line_bytes: int, on_oversized: Callable[[bytes, int], None]) -> None:
        self.resp = resp
        self.deadline = deadline  # loop time
        self.stall_timeout = stall_timeout
        self.max_line_bytes = max_line_bytes
        self.on_oversized = on_oversized
        self.tally = StreamTally()

    async def events(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Decoded events as they come; raises _Stalled when the stream goes quiet,
        _Overdue at the deadline. The loop gets a turn every YIELD_EVERY lines, after the
        line's event was handled.

        Lines are cut out of the chunks and decoded here, not in a generator and a
        function of their own (each hop costs 2% of a bare watch's time): a line is the
        buffer itself (no copy), pieces of chunks are appended through memoryviews (no
        copy either).
        """
        tally, limit = self.tally, self.max_line_bytes
        buf = bytearray()  # the line being read
        discarding = False  # the rest of an oversized line is dropped
        while chunk := await self._read():
            start = 0
            while True:
                nl = chunk.find(b"\n", start)
                end = len(chunk) if nl < 0 else nl
                if not discarding and len(buf) + end - start > limit:
                    discarding = True
                    tally.oversized += 1
                    self.on_oversized(bytes(buf[:_HEAD]) + chunk[start:start + _HEAD],
                                      tally.oversized)
                    buf.clear()
                if nl < 0:
                    if not discarding:
                        buf += memoryview(chunk)[start:]
                    break
                if discarding:
                    discarding = False
                else:
                    buf += memoryview(chunk)[start:nl]
                    if buf and not buf.isspace():
                        tally.lines += 1
                        event = orjson.loads(buf)
                        kind, obj = event.get("type"), event.get("object")
                        if kind not in EVENT_TYPES or not isinstance(obj, dict):
                            raise _not_an_event(kind, obj, buf)
                        if kind == "BOOKMARK":
                            tally.bookmarks += 1
                        else:
                            tally.events += 1
                        yield kind, obj
                        if tally.lines % YIELD_EVERY == 0:
                            await asyncio.sleep(0)
                buf.clear()
                start = nl + 1

    async def _read(self) -> bytes:
        """The next chunk of the stream (b"" at its end), within stall_timeout and the
        deadline."""
        loop = asyncio.get_running_loop()
        timer = asyncio.timeout_at(min(loop.time() + self.stall_timeout, self.deadline))
        async with time_limit(timer, self._late):
            chunk = await self.resp.readany()
        if chunk:
            if loop.time() >= self.deadline:  # a stream that always has data never times out
                raise _Overdue()
            self.tally.heard = True
        return chunk

    def _late(self) -> Exception:
        """Quiet for stall_timeout, or open past the deadline."""
        return _Overdue() if asyncio.get_running_loop().time() >= self.deadline else _Stalled()


def _not_an_event(kind: object, obj: object, line: bytearray) -> Exception:
    """What to raise for a watch line that is no event we take: an ERROR event (410:
    _Gone), or something malformed."""
    if not isinstance(obj, dict):
        return ValueError(f"watch event without an object: {line[:200]!r}")
    if kind == "ERROR":
        code = obj.get("code")
        if code == 410:
            return _Gone()
        return _HttpError(int(code or 0), str(obj.get("message") or obj))
    return ValueError(f"unknown watch event type {kind!r}")


def identify_head(head: bytes) -> str:
    """namespace/name of an object from the start of its JSON, if it shows there (the
    API server writes metadata.name and namespace before labels and the rest)."""
    name, namespace = _NAME.search(head), _NAMESPACE.search(head)
    if name is None:
        return "?"
    ns = namespace.group(1).decode("utf-8", "replace") + "/" if namespace else ""
    return ns + name.group(1).decode("utf-8", "replace")
