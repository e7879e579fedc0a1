"""List, then watch, one resource, and never miss a change.

The loop follows the Kubernetes "API concepts" contract:

* list (paged with `limit`/`continue`, a consistent snapshot) and remember the list's
  resourceVersion; then watch from it with bookmarks, resuming from the last
  resourceVersion seen (an event's or a bookmark's) whenever a stream ends or breaks;
* `410 Gone` (on the request, or as an ERROR event on an open stream) means the history
  we need is compacted away: list again and emit exactly the differences from what we
  knew (adds, updates, and deletes of objects that vanished meanwhile);
* an expired `continue` token restarts the list from the beginning, in one unpaged
  request (as client-go's pager does), so a list slower than compaction still finishes;
* errors back off exponentially with jitter, honouring `Retry-After`; so does a stream
  that ends within a second having delivered nothing (client-go's "very short watch"),
  so a server that closes every watch at once is not hammered;
* a stream that delivers neither event nor bookmark for `stall_timeout` is restarted;
  if the next stream is silent too, one small list (`limit=1`) asks the server for its
  current revision and one object, and the reflector relists if the revision is below
  the one we resume from or the object contradicts what we hold.
  A server that lost its storage counts revisions from 1 again, and a watch resumed from
  our (now future) resourceVersion is answered with silence until the new cluster
  catches up: the watch cache sends neither events nor bookmarks older than the start.
  Listing again is the only way back to the truth (client-go has no stall detector and
  waits). A quiet resource on a healthy server is silent too (the watch cache sends no
  bookmark when nothing changed), so silence alone must not cost a full relist.

The reflector keeps only (namespace, name) -> resourceVersion and uid per object: enough
to emit exact differences on a relist without holding a second copy of every object. The
uid matters after storage is lost: the new cluster counts revisions from 1 again, so an
object created again under the same name (the same manifests applied in the same order)
may come back at the very resourceVersion we hold for the old one, with other content.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.kube.client import Api, Response
from proxy.kube.resources import Resource

log = logging.getLogger(__name__)

ObjectKey = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: str  # "ADDED", "MODIFIED" or "DELETED"
    resource: Resource
    namespace: str
    name: str
    # The object as the server sent it; None for a deletion found by a relist (the
    # object is already gone from the server and we keep no copy).
    obj: dict[str, Any] | None


@dataclass(slots=True)
class ReflectorStats:
    lists: int = 0  # completed lists, the first included
    relists: int = 0  # lists after the first (410 Gone, or a server behind our revision)
    expired: int = 0  # 410 Gone answers: watch history, or a list's continue token
    watches: int = 0  # watch streams opened
    watch_restarts: int = 0  # streams the server ended (timeoutSeconds), reopened
    short_watches: int = 0  # streams that ended within a second with nothing delivered
    stalls: int = 0
    probes: int = 0  # one-item lists after silent streams, checking the server's revision
    errors: int = 0
    events: int = 0
    bookmarks: int = 0
    oversized: int = 0
    last_error: str = ""


@dataclass(frozen=True, slots=True)
class ReflectorOptions:
    label_selector: str | None = None
    field_selector: str | None = None
    page_size: int = 500
    # Watch streams last a random time in [min_watch_timeout, 2*min_watch_timeout) so that
    # many agents do not reconnect in step (as client-go does).
    min_watch_timeout: float = 300.0
    request_timeout: float = 60.0
    stall_timeout: float = 150.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    max_line_bytes: int = 16 * 2**20


class _Gone(Exception):
    pass


class _HttpError(Exception):
    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.retry_after = retry_after


class _Stalled(Exception):
    pass


class _ShortWatch(Exception):
    pass


# A stream that ends sooner than this having delivered nothing is treated as an error.
SHORT_WATCH_SECONDS = 1.0
# Consecutive silent streams after which we ask whether the server is still the one whose
# revisions we follow (see _check_server_revision).
STALLS_BEFORE_PROBE = 2


class Backoff:
    """Exponential backoff with full jitter, reset after a success."""

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self.initial, self.maximum = initial, maximum
        self._attempt = 0
        self._rng = rng or random.Random()

    def next(self, at_least: float = 0.0) -> float:
        ceiling = min(self.maximum, self.initial * 2**self._attempt)
        self._attempt += 1
        return max(at_least, self._rng.uniform(ceiling / 2, ceiling))

    def reset(self) -> None:
        self._attempt = 0


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _key(obj: Mapping[str, Any]) -> ObjectKey:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def _rv(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def _uid(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


class Reflector:
    def __init__(
        self,
        api: Api,
        resource: Resource,
        handler: Callable[[WatchEvent], None],
        options: ReflectorOptions | None = None,
    ) -> None:
        self.api = api
        self.resource = resource
        self.handler = handler
        self.options = options or ReflectorOptions()
        self.synced = asyncio.Event()
        self.stats = ReflectorStats()
        self.resource_version: str | None = None
        # (resourceVersion, uid) of every object we know.
        self._objects: dict[ObjectKey, tuple[str, str]] = {}
        self._backoff = Backoff(self.options.backoff_initial, self.options.backoff_max)
        self._unpaged_next = False  # the last paged list lost its continue token
        self._stalls_in_a_row = 0
        self._probe_next = False  # silent streams in a row: is the server behind us?

    @property
    def known(self) -> Mapping[ObjectKey, str]:
        """(namespace, name) -> resourceVersion of every object currently known (a
        copy: for tests, the dump and logs, not the hot path)."""
        return {key: rv for key, (rv, _uid) in self._objects.items()}

    @property
    def object_count(self) -> int:
        return len(self._objects)

    def _selectors(self) -> dict[str, str]:
        query: dict[str, str] = {}
        if self.options.label_selector:
            query["labelSelector"] = self.options.label_selector
        if self.options.field_selector:
            query["fieldSelector"] = self.options.field_selector
        return query

    async def run(self) -> None:
        """Run until cancelled. Never raises for API trouble: it logs, counts and retries."""
        while True:
            try:
                if self._probe_next:
                    self._probe_next = False
                    await self._check_server_revision()
                if self.resource_version is None:
                    await self._list()
                await self._watch()
            except asyncio.CancelledError:
                raise
            except _Gone:
                listing = self.resource_version is None
                self.stats.expired += 1
                if listing:
                    self._unpaged_next = True
                log.info("%s; listing again", "the list's continue token expired (410 Gone)"
                         if listing else "watch history expired (410 Gone)",
                         extra={"resource": str(self.resource),
                                "resource_version": self.resource_version})
                self.resource_version = None
            except _Stalled:
                self.stats.stalls += 1
                self._stalls_in_a_row += 1
                probe = self._stalls_in_a_row >= STALLS_BEFORE_PROBE
                log.info("no event or bookmark for %.0fs; %s", self.options.stall_timeout,
                         "checking the server's revision before watching again"
                         if probe else "restarting the watch",
                         extra={"resource": str(self.resource),
                                "resource_version": self.resource_version,
                                "stalls_in_a_row": self._stalls_in_a_row})
                if probe:
                    self._stalls_in_a_row = 0
                    self._probe_next = True
            except Exception as exc:  # network, HTTP and parse errors alike: back off, retry
                listing = self.resource_version is None
                self.stats.errors += 1
                if isinstance(exc, _ShortWatch):
                    self.stats.short_watches += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                at_least = (exc.retry_after or 0.0) if isinstance(exc, _HttpError) else 0.0
                delay = self._backoff.next(at_least)
                log.warning("%s %s failed: %s; retrying in %.2fs",
                            "list" if listing else "watch",
                            self.resource, self.stats.last_error, delay,
                            extra={"resource": str(self.resource),
                                   "retry_after": at_least or None})
                await asyncio.sleep(delay)

    # --- list ------------------------------------------------------------------------

    async def _check_server_revision(self) -> None:
        """After silent streams, one small list (same selectors, `limit=1`): relist if the
        server is not the one we have been following — its revision is below ours, or
        the object it shows contradicts what we hold at a revision we have passed (a new
        cluster that counted up to our revision again) — or if we cannot tell."""
        self.stats.probes += 1
        body = await self._get_json({**self._selectors(), "limit": "1"},
                                    self.options.request_timeout)
        current = str((body.get("metadata") or {}).get("resourceVersion") or "")
        ours = self.resource_version
        why = None
        # resourceVersions are opaque to clients; etcd's are integers. Anything else
        # cannot be judged: relist to be safe.
        if not (current.isdigit() and ours is not None and ours.isdigit()):
            why = "revisions cannot be compared"
        elif int(current) < int(ours):
            why = "its revision is below ours: did it lose its storage?"
        else:
            for item in body.get("items") or []:
                rv, key = _rv(item), _key(item)
                if rv.isdigit() and int(rv) <= int(ours) and (
                        self._objects.get(key) != (rv, _uid(item))):
                    why = (f"{key[0]}/{key[1]} at {rv} is not the object we hold: "
                           "did it lose its storage?")
        if why is not None:
            log.warning("after silent watches, the server (revision %s) looks new: %s; "
                        "listing again", current or "?", why, extra={
                            "resource": str(self.resource), "resource_version": ours,
                            "server_resource_version": current})
            self.resource_version = None

    async def _list(self) -> None:
        seen: set[ObjectKey] = set()
        token: str | None = None
        unpaged, self._unpaged_next = self._unpaged_next, False
        while True:
            query = self._selectors()
            if not unpaged:
                query["limit"] = str(self.options.page_size)
            if token:
                query["continue"] = token
            body = await self._get_json(query, self.options.request_timeout)
            for item in body.get("items") or []:
                # List items carry no kind/apiVersion; the decoder needs both.
                item.setdefault("kind", self.resource.kind)
                item.setdefault("apiVersion", self.resource.api_version)
                key = _key(item)
                seen.add(key)
                old = self._objects.get(key)
                self._objects[key] = now = (_rv(item), _uid(item))
                # resourceVersions alone can repeat across a storage loss (see above)
                if old != now:
                    self._emit("ADDED" if old is None else "MODIFIED", key, item)
            meta = body.get("metadata") or {}
            token = meta.get("continue") or None
            if token is None:
                list_rv = str(meta.get("resourceVersion") or "")
                break
        for key in [k for k in self._objects if k not in seen]:
            del self._objects[key]
            self._emit("DELETED", key, None)
        self.resource_version = list_rv
        if self.stats.lists:
            self.stats.relists += 1
        self.stats.lists += 1
        self._backoff.reset()
        if not self.synced.is_set():
            log.info("initial list done", extra={"resource": str(self.resource),
                                                 "objects": len(self._objects),
                                                 "resource_version": list_rv})
        self.synced.set()

    async def _get_json(self, query: dict[str, str], timeout: float) -> dict[str, Any]:
        resp = await self.api.get(self.resource.path, query, timeout)
        try:
            data = await resp.read()
            if resp.status == 410:
                # An expired continue token: the snapshot is gone; start the list again.
                raise _Gone()
            if resp.status != 200:
                raise _HttpError(resp.status, _status_message(data), _retry_after(resp.headers))
            body = orjson.loads(data)
            if not isinstance(body, dict):
                raise _HttpError(resp.status, "list response is not an object")
            return body
        finally:
            resp.close()

    # --- watch -----------------------------------------------------------------------

    async def _watch(self) -> None:
        timeout = max(1, int(self.options.min_watch_timeout * (1 + random.random())))
        query = {
            "watch": "1",
            "resourceVersion": self.resource_version or "",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout),
            **self._selectors(),
        }
        loop = asyncio.get_running_loop()
        # The whole stream may last the server's timeout and a margin; the answer to the
        # request itself must come within request_timeout like any other.
        async with asyncio.timeout(self.options.request_timeout):
            resp = await self.api.get(self.resource.path, query, timeout + 30)
        try:
            if resp.status == 410:
                raise _Gone()
            if resp.status != 200:
                data = await resp.read()
                raise _HttpError(resp.status, _status_message(data), _retry_after(resp.headers))
            self.stats.watches += 1
            started, lines = loop.time(), 0
            async for line in self._lines(resp):
                lines += 1
                self._handle_line(line)
            if not lines and loop.time() - started < SHORT_WATCH_SECONDS:
                raise _ShortWatch("the stream ended at once with nothing delivered")
            self.stats.watch_restarts += 1  # the server ended the stream (timeoutSeconds)
        finally:
            resp.close()

    def _handle_line(self, line: bytes) -> None:
        event = orjson.loads(line)
        kind = event.get("type")
        obj = event.get("object")
        if not isinstance(obj, dict):
            raise ValueError(f"watch event without an object: {line[:200]!r}")
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            self.resource_version = _rv(obj) or self.resource_version
            self._backoff.reset()
            return
        if kind == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise _Gone()
            raise _HttpError(int(code or 0), str(obj.get("message") or obj))
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            raise ValueError(f"unknown watch event type {kind!r}")
        key = _key(obj)
        rv = _rv(obj)
        if kind == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = (rv, _uid(obj))
        if rv:
            self.resource_version = rv
        self._backoff.reset()
        self._emit(kind, key, obj)

    async def _lines(self, resp: Response) -> AsyncIterator[bytes]:
        """JSON lines of a watch stream; restarts (raises _Stalled) when it goes quiet.

        A line longer than `max_line_bytes` is dropped as it streams by (never held
        whole) and counted: no real API server sends objects that big (etcd refuses
        them), so it comes from a broken or hostile server.
        """
        buf = bytearray()
        head = b""  # the start of a line being discarded, to name the object in the log
        discarding = False
        limit = self.options.max_line_bytes
        while True:
            try:
                async with asyncio.timeout(self.options.stall_timeout):
                    chunk = await resp.readany()
            except TimeoutError:
                raise _Stalled() from None
            if not chunk:
                return
            self._stalls_in_a_row = 0  # the server is talking
            start = 0
            while True:
                nl = chunk.find(b"\n", start)
                end = len(chunk) if nl < 0 else nl
                if not discarding and len(buf) + end - start > limit:
                    discarding, head = True, bytes(buf[:_HEAD]) + chunk[start:start + _HEAD]
                    buf.clear()
                if nl < 0:
                    if not discarding:
                        buf += chunk[start:]
                    break
                if discarding:
                    self.stats.oversized += 1
                    log.error("watch event over %d bytes skipped", limit,
                              extra={"resource": str(self.resource),
                                     "object": _identify(head)})
                    discarding = False
                else:
                    buf += chunk[start:nl]
                    if buf.strip():
                        yield bytes(buf)
                buf.clear()
                start = nl + 1

    def _emit(self, kind: str, key: ObjectKey, obj: dict[str, Any] | None) -> None:
        self.stats.events += 1
        try:
            self.handler(WatchEvent(kind, self.resource, key[0], key[1], obj))
        except Exception:  # a bug downstream must not stop the watch
            log.exception("event handler failed", extra={"resource": str(self.resource),
                                                          "object": f"{key[0]}/{key[1]}"})


_HEAD = 4096
_NAME = re.compile(rb'"name":"([^"]{1,253})"')
_NAMESPACE = re.compile(rb'"namespace":"([^"]{1,63})"')


def _identify(head: bytes) -> str:
    """namespace/name of an object from the start of its JSON, if it shows there (the
    API server writes metadata.name and namespace before labels and the rest)."""
    name, namespace = _NAME.search(head), _NAMESPACE.search(head)
    if name is None:
        return "?"
    ns = namespace.group(1).decode("utf-8", "replace") + "/" if namespace else ""
    return ns + name.group(1).decode("utf-8", "replace")


def _status_message(data: bytes) -> str:
    try:
        status = orjson.loads(data)
        if isinstance(status, dict) and status.get("message"):
            return str(status["message"])
    except orjson.JSONDecodeError:
        pass
    return data[:200].decode("utf-8", "replace")

