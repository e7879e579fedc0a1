"""One watch stream: which events it sends, in what form, and when it ends.

Semantics follow the API server's watch cache (`cacheWatcher`):
- start: no resourceVersion or "0" -> synthetic ADDED events for the current state, then
  changes; rv=N -> every retained change after N; N older than the retained history ->
  HTTP 200 with one ERROR event carrying a 410 Expired Status, then the end of the stream.
  N newer than the store (a client of a cluster that lost its storage and counts from 1
  again) -> no error: the stream stays silent until revisions pass N, as the watch cache
  does (`cacheWatcher` only sends events, and bookmarks, newer than its start).
- selectors are applied to both the old and the new object, so an object that stops
  matching is sent as DELETED (its previous content, stamped with the event's rv) and one
  that starts matching as ADDED.
- BOOKMARK events carry only kind, apiVersion and metadata.resourceVersion; they are sent
  only when nothing is queued, so a bookmark never claims a revision whose event has not
  yet been written to this stream.
- `expire` (fault injection) ends an open stream with an ERROR 410 event, as the server
  does when etcd compacts under a watch that has fallen behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.sim.errors import ApiError
from proxy.sim.resources import ResourceType
from proxy.sim.store import DELETED, Event, Obj, Store, parse_rv

log = logging.getLogger("proxy.sim.watch")

Matcher = Callable[[Mapping[str, Any]], bool]
Line = bytes


def encode(kind: str, obj: Mapping[str, Any]) -> Line:
    return orjson.dumps({"type": kind, "object": obj}) + b"\n"


def bookmark(rt: ResourceType, rv: int, initial_events_end: bool = False) -> Line:
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if initial_events_end:
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    return encode("BOOKMARK", {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta})


def transition(ev: Event, match: Matcher) -> tuple[str, Obj] | None:
    """The event this watcher sees for a change, given its selectors (None: nothing)."""
    now_matches = ev.type != DELETED and match(ev.obj)
    was_matching = ev.prev is not None and match(ev.prev)
    if now_matches:
        return ("MODIFIED" if was_matching else "ADDED"), ev.obj
    if not was_matching:
        return None
    if ev.type == DELETED:
        return DELETED, ev.obj
    assert ev.prev is not None
    gone = dict(ev.prev)
    gone["metadata"] = {**ev.prev["metadata"], "resourceVersion": str(ev.rv)}
    return DELETED, gone


@dataclass(slots=True)
class WatchParams:
    rt: ResourceType
    namespace: str | None
    match: Matcher
    resource_version: str | None
    bookmarks: bool
    timeout: float
    send_initial_events: bool = False


PRE_TIMEOUT_BOOKMARK = 2.0  # seconds before a watch's deadline (upstream cacher)
CUT = None  # queued to end a stream (fault injection, shutdown)
Queued = Event | ApiError | None  # an event, an error to end with, or CUT


class Watch:
    """Registered with the store at construction, so no change can fall between the
    initial events and the live ones."""

    def __init__(self, store: Store, params: WatchParams, bookmark_interval: float) -> None:
        self.params = params
        self.bookmark_interval = bookmark_interval
        self.queue: asyncio.Queue[Queued] = asyncio.Queue()
        self.initial: list[Line] = []
        self.error: ApiError | None = None
        self.sent = 0
        self._store = store
        self._unsubscribe: Callable[[], None] | None = None
        # Events (and bookmarks) at or below this revision are not sent.
        self.floor = 0
        p = params
        rv = p.resource_version
        try:
            if p.send_initial_events or not rv or rv == "0":
                for obj in store.list_objects(p.rt, p.namespace).items:
                    if p.match(obj):
                        self.initial.append(encode("ADDED", obj))
                if p.send_initial_events:
                    self.initial.append(bookmark(p.rt, store.rv, initial_events_end=True))
            else:
                self.floor = parse_rv(rv)
                for ev in store.events_since(p.rt, self.floor):
                    self._offer(ev, self.initial)
        except ApiError as exc:
            if exc.code == 400:
                raise
            self.error = exc
            return
        self._unsubscribe = store.subscribe(self._on_event)

    def _relevant(self, ev: Event) -> bool:
        return ev.rt is self.params.rt and (
            not self.params.namespace or ev.namespace == self.params.namespace)

    def _offer(self, ev: Event, out: list[Line]) -> None:
        if not self._relevant(ev) or ev.rv <= self.floor:
            return
        seen = transition(ev, self.params.match)
        if seen is not None:
            out.append(encode(*seen))

    def _on_event(self, ev: Event) -> None:
        if self._relevant(ev):
            self.queue.put_nowait(ev)

    def cut(self) -> None:
        self.queue.put_nowait(CUT)

    def expire(self, error: ApiError) -> None:
        self.queue.put_nowait(error)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    async def lines(self) -> AsyncIterator[Line]:
        """Async iterator of encoded lines until timeout, cut or error."""
        if self.error is not None:
            yield encode("ERROR", self.error.status())
            return
        for line in self.initial:
            yield line
        deadline = time.monotonic() + self.params.timeout
        next_bookmark = time.monotonic() + self.bookmark_interval
        # As the watch cache: one more bookmark 2 s before the deadline, so a client that
        # resumes after the timeout starts from the freshest revision (client-go relies
        # on it; measured against kube-apiserver v1.20.2 in tests/realcp).
        pre_timeout = deadline - PRE_TIMEOUT_BOOKMARK
        while True:
            now = time.monotonic()
            if now >= deadline:
                return
            if self.params.bookmarks and self.queue.empty() and (
                    now >= next_bookmark or now >= pre_timeout):
                if self._store.rv > self.floor:
                    yield bookmark(self.params.rt, self._store.rv)
                next_bookmark = now + self.bookmark_interval
                if now >= pre_timeout:
                    pre_timeout = deadline  # sent; only the periodic ones remain
                continue
            wait = deadline - now
            if self.params.bookmarks:
                wait = min(wait, max(min(next_bookmark, pre_timeout) - now, 0))
            try:
                async with asyncio.timeout(wait):
                    ev = await self.queue.get()
            except TimeoutError:
                continue
            if ev is CUT:
                return
            if isinstance(ev, ApiError):
                yield encode("ERROR", ev.status())
                return
            out: list[Line] = []
            self._offer(ev, out)
            for line in out:
                yield line
