"""List, then watch, one resource, and never miss a change.

The loop follows the Kubernetes "API concepts" contract:

* list and remember the list's resourceVersion; then watch from it with bookmarks,
  resuming from the last resourceVersion seen (an event's or a bookmark's) whenever a
  stream ends or breaks;
* lists spare the server as client-go's reflector does (5,000 agents list at once in a
  DaemonSet rollout): the first asks for `resourceVersion=0`, which the API server
  answers from its watch cache, whole (no read from etcd; a server without the cache
  pages it: `limit` is sent); a relist after a watch's history expired asks for the
  revision we had reached, without `limit`, also answered from the cache and never
  older than what we hold; only when that fails (410, or 504 "too large resource
  version": the server's storage went back) or the server went back in time is the
  list a consistent, paged read from etcd (`resourceVersion` unset);
* `410 Gone` (on the request, or as an ERROR event on an open stream) means the history
  we need is compacted away: list again and emit exactly the differences from what we
  knew (adds, updates, and deletes of objects that vanished meanwhile);
* an expired `continue` token restarts the list from the beginning, in one unpaged
  request (as client-go's pager does), so a list slower than compaction still finishes;
* errors back off exponentially with jitter, honouring `Retry-After`; so does a stream
  that ends within a second having delivered nothing (client-go's "very short watch"),
  so a server that closes every watch at once is not hammered. The cap (8 s) is set by
  how soon a change must reach the node after an API server outage (see `Backoff`);
* relists the server forces (410 Gone, revisions going back) are immediate once in a
  while and back off when they come in a row, so a server that answers every watch that
  way does not get a full list per round trip (client-go backs off before every relist);
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

A broken or hostile server cannot take more than bounded memory, nor wedge the loop
(docs/watch.md lists each case and its measured bound):

* a watch line over `max_line_bytes` is dropped as it streams by, never held whole;
* a stream the server keeps open past the timeoutSeconds we asked for (events or
  bookmarks without end) is ended by us after a grace period, and reopened;
* a list response holding over `max_list_bytes` not cut into items (items are taken as
  they arrive and their bytes dropped; a body read on at most half that far ahead of
  them), a paged list past `max_list_pages` pages
  or `max_list_items` objects, or one that repeats an object (pages that loop) is given
  up and retried with backoff; error bodies are read up to 64 KiB; every list request,
  body included, ends within `request_timeout` (not counting the time we spend decoding
  its items as they arrive: at most `request_timeout` more);
* resourceVersions going backwards on a watch stream (an event or bookmark older than
  the revision we resume from) end the stream and relist: a list is a consistent read,
  the one way back to the truth. client-go takes every event's resourceVersion as it
  comes and would resume from the older one: the server then replays history we already
  applied (objects going back in time), or answers 410 and it relists anyway. A list
  whose revision is below the one we had reached is taken as the truth (our lists are
  consistent reads, so the server's storage went back: restored or lost), logged once;
* the loop yields to the event loop every `YIELD_EVERY` lines, so a server streaming as
  fast as it can does not starve the agent's other tasks.

Each incident is one log line with the resource and what was wrong, not one per event.

This module holds the run loop (list, watch, relist, back off) and what the reflector
knows of each object; the jobs it hands out have modules of their own: list_pager.py
(a list's pages, their items passed on as they arrive), watch_stream.py (a watch's lines
decoded into events, its stall and overdue timeouts), backoff.py (the delays between
attempts) and request_errors.py (what a request can run into, as exceptions the loop
handles).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.kube.backoff import Backoff
from proxy.kube.client import Api
from proxy.kube.identity import ObjectKey, decimal, meta_uid, meta_version, object_key, unkeyed_key
from proxy.kube.identity import key as identify
from proxy.kube.list_pager import ListPager
from proxy.kube.request_errors import (
    _BadList,
    _Gone,
    _HttpError,
    _Overdue,
    _ShortWatch,
    _Stalled,
    _WentBack,
)
from proxy.kube.resources import Resource
from proxy.kube.watch_stream import WatchStream, identify_head, open_watch
from proxy.model.skips import shown

log = logging.getLogger(__name__)


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
    went_back: int = 0  # resourceVersions below ours: watch events, bookmarks or a list
    overdue: int = 0  # streams we ended: the server kept them open past timeoutSeconds
    bad_lists: int = 0  # lists given up: too large, too many pages or items, repeating
    # Objects without a usable (namespace, name) (metadata [], a name that is no
    # string, an item that is no object): passed on under a key of their own (identity.py)
    unkeyed: int = 0
    last_error: str = ""
    retry_delay: float = 0.0  # the last backoff delay chosen, in seconds


@dataclass(frozen=True, slots=True)
class ReflectorOptions:
    label_selector: str | None = None
    field_selector: str | None = None
    page_size: int = 500
    # The first list from etcd (consistent, paged) rather than from the watch cache
    # (resourceVersion=0): fresher on a cluster of API servers whose caches lag, at a
    # cost to etcd that 5,000 nodes listing at once make large. Off, as in client-go.
    consistent_first_list: bool = False
    # Watch streams last a random time in [min_watch_timeout, 2*min_watch_timeout) so that
    # many agents do not reconnect in step (as client-go does).
    min_watch_timeout: float = 300.0
    request_timeout: float = 60.0
    stall_timeout: float = 150.0
    backoff_initial: float = 0.5
    # 8 s, not client-go's 30 s: it bounds how long a node waits once an API server is
    # back (see Backoff for the numbers).
    backoff_max: float = 8.0
    # No real API server comes near these (etcd refuses objects over 1.5 MiB; the
    # Kubernetes scalability limits are 10,000 services and about 150,000 pods): they only
    # stop a broken or hostile server from taking all the memory there is.
    max_line_bytes: int = 16 * 2**20
    max_list_bytes: int = 256 * 2**20  # of a list response's body not cut into items
    max_list_pages: int = 10_000
    max_list_items: int = 1_000_000


# A stream that ends sooner than this having delivered nothing is treated as an error.
SHORT_WATCH_SECONDS = 1.0
# How long past its timeoutSeconds (this, or the timeout itself if shorter) a stream may
# stay open before we end it: the server ignores the timeout we asked for.
WATCH_GRACE = 30.0
# A forced relist (410, revisions going back) longer than this after the previous one is
# immediate; sooner, it backs off (client-go resets its backoff after 2 minutes).
RELIST_QUIET = 120.0
# Consecutive silent streams after which we ask whether the server is still the one whose
# revisions we follow (see _check_server_revision).
STALLS_BEFORE_PROBE = 2


def _older(rv: str, than: str | None) -> bool:
    """rv is a revision before `than`. resourceVersions are opaque to clients, but etcd's
    are integers and every server we know uses them; anything else cannot be judged and
    is taken as it comes."""
    mine, theirs = decimal(rv), decimal(than)
    return mine is not None and theirs is not None and mine < theirs


def _in(delay: float) -> str:
    return f" in {delay:.2f}s" if delay else ""


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
        self._relist_backoff = Backoff(self.options.backoff_initial, self.options.backoff_max)
        self._last_forced_relist: float | None = None
        self._unpaged_next = False  # the last paged list lost its continue token
        # The resourceVersion the next list asks for (client-go's relistResourceVersion):
        # "0" (any: the watch cache), the revision we had reached (not older than it:
        # the cache again), or "" (a consistent read from etcd). See the module's doc.
        self._list_from = "" if self.options.consistent_first_list else "0"
        self._stalls_in_a_row = 0
        self._probe_next = False  # silent streams in a row: is the server behind us?
        # The revision we had reached before a relist, to tell a list that went back; and
        # whether that was already explained (a probe or a watch found it), so an incident
        # is logged once.
        self._reached: str | None = None
        self._lower_explained = False

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

    def _pager(self) -> ListPager:
        opts = self.options
        return ListPager(self.api, self.resource, page_size=opts.page_size,
                         max_pages=opts.max_list_pages, max_bytes=opts.max_list_bytes,
                         request_timeout=opts.request_timeout)

    def _extra(self, **more: object) -> dict[str, object]:
        return {"resource": str(self.resource), "resource_version": self.resource_version,
                **more}

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
                await asyncio.sleep(self._expired())
            except _WentBack as exc:
                await asyncio.sleep(self._went_back(exc))
            except _Stalled:
                self._stalled()
            except Exception as exc:  # network, HTTP and parse errors alike: back off, retry
                await asyncio.sleep(self._failed(exc))

    # --- what the loop does after each way a list or watch can end ---------------------

    def _expired(self) -> float:
        """410 Gone: list again; the delay before it."""
        listing = self.resource_version is None
        self.stats.expired += 1
        if listing:
            # The continue token (or the revision asked for) is gone: one unpaged
            # consistent list, as client-go's pager falls back to.
            self._unpaged_next = True
            self._list_from = ""
        delay = self._relist_delay()
        log.info("%s; listing again%s", "the list's continue token expired (410 Gone)"
                 if listing else "watch history expired (410 Gone)", _in(delay),
                 extra=self._extra())
        self._forget_revision()
        return delay

    def _went_back(self, exc: _WentBack) -> float:
        self.stats.went_back += 1
        delay = self._relist_delay()
        log.warning("watch of %s went back in time: %s; listing again%s",
                    self.resource, exc, _in(delay), extra=self._extra())
        self._forget_revision(explained=True)
        return delay

    def _stalled(self) -> None:
        """A silent stream: watch again at once; after STALLS_BEFORE_PROBE in a row, ask
        the server for its revision first."""
        self.stats.stalls += 1
        self._stalls_in_a_row += 1
        probe = self._stalls_in_a_row >= STALLS_BEFORE_PROBE
        log.info("no event or bookmark for %.0fs; %s", self.options.stall_timeout,
                 "checking the server's revision before watching again"
                 if probe else "restarting the watch",
                 extra=self._extra(stalls_in_a_row=self._stalls_in_a_row))
        if probe:
            self._stalls_in_a_row = 0
            self._probe_next = True

    def _failed(self, exc: Exception) -> float:
        """Any other failure: counted, logged, and the backoff's next delay."""
        listing = self.resource_version is None
        self.stats.errors += 1
        if isinstance(exc, _ShortWatch):
            self.stats.short_watches += 1
        if isinstance(exc, _BadList):
            self.stats.bad_lists += 1
        if listing and isinstance(exc, _HttpError) and exc.status == 504 and \
                self._list_from not in ("", "0"):
            # "Too large resource version": the server is behind the revision we had
            # reached (its storage went back); only etcd can say where.
            self._list_from = ""
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        at_least = (exc.retry_after or 0.0) if isinstance(exc, _HttpError) else 0.0
        delay = self.stats.retry_delay = self._backoff.next(at_least)
        log.warning("API request failed; retrying",
                    extra={"request": "list" if listing else "watch",
                           "resource": str(self.resource),
                           "error": self.stats.last_error,
                           "retry_in": round(delay, 2),
                           "retry_after": at_least or None})
        return delay

    def _forget_revision(self, explained: bool = False) -> None:
        """List again at the next turn. `explained`: the server going back in time has
        been logged already, so a list below our revision is not logged again."""
        if self.resource_version is not None:
            # An expired history only needs a state no older than ours (the cache has
            # it); a server that went back (explained) has none: ask etcd.
            self._reached = self._list_from = self.resource_version
        if explained:
            self._list_from = ""
        self.resource_version = None
        self._lower_explained = self._lower_explained or explained

    def _relist_delay(self) -> float:
        """No wait before a relist the server forced, unless the previous one was less
        than RELIST_QUIET ago: then the backoff's next delay. A server that answers every
        watch with 410, or with revisions going back, gets a list every backoff_max at
        most, not one per round trip."""
        now = asyncio.get_running_loop().time()
        last, self._last_forced_relist = self._last_forced_relist, now
        if last is None or now - last > RELIST_QUIET:
            self._relist_backoff.reset()
            return 0.0
        return self._relist_backoff.next()

    # --- list ------------------------------------------------------------------------

    async def _check_server_revision(self) -> None:
        """After silent streams, one small list (same selectors, `limit=1`): relist if the
        server is not the one we have been following — its revision is below ours, or
        the object it shows contradicts what we hold at a revision we have passed (a new
        cluster that counted up to our revision again) — or if we cannot tell."""
        self.stats.probes += 1
        body = await self._pager().whole({**self._selectors(), "limit": "1"})
        current = meta_version(body)
        ours = decimal(self.resource_version)
        theirs = decimal(current)
        why = None
        # resourceVersions are opaque to clients; etcd's are integers. Anything else
        # cannot be judged: relist to be safe.
        if ours is None or theirs is None:
            why = "revisions cannot be compared"
        elif theirs < ours:
            why = "its revision is below ours: did it lose its storage?"
        else:
            items = body.get("items")
            for item in items if isinstance(items, list) else []:
                rv, key = meta_version(item), object_key(item)
                at = decimal(rv)
                if at is not None and at <= ours and (
                        self._objects.get(key) != (rv, meta_uid(item))):
                    why = (f"{key[0]}/{key[1]} at {rv} is not the object we hold: "
                           "did it lose its storage?")
        if why is not None:
            log.warning("after silent watches, the server (revision %s) looks new: %s; "
                        "listing again", current or "?", why,
                        extra=self._extra(server_resource_version=current))
            self._forget_revision(explained=True)

    async def _list(self) -> None:
        """One whole list (list_pager.py), its items passed on as they arrive."""
        seen: set[ObjectKey] = set()
        unkeyed = _Tally()  # objects without a usable name, for one log line
        unpaged, self._unpaged_next = self._unpaged_next, False
        since = self._list_from
        head, pages = await self._pager().list(self._selectors(), since, unpaged,
                                             functools.partial(self._pass_on, seen, unkeyed))
        self._list_done(seen, unkeyed, meta_version(head), since, pages)

    def _pass_on(self, seen: set[ObjectKey], unkeyed: _Tally, items: Iterator[Any],
                 page: int) -> int:
        """Pass on what these items of a list added or changed; how many there were."""
        count = 0
        for item in items:
            count += 1
            if not isinstance(item, dict):
                # Not an object: nothing to decode, no kind to record it under.
                # Counted (stats, the dump's watch section) and logged below.
                unkeyed.note(f"an item {shown(item)}, not an object")
                self.stats.unkeyed += 1
                continue
            key, named = self._key(item)
            if not named:
                # Passed on all the same, under a key of its own, so the decoder
                # records why it is skipped; identical ones are one object.
                unkeyed.note(_why_unkeyed(item))
                if key in seen:
                    continue
            # A list is one consistent snapshot: an object twice means pages that
            # overlap or loop (and a list that would never end).
            elif key in seen:
                raise _BadList(f"the list repeated {key[0]}/{key[1]} (page {page})")
            seen.add(key)
            if len(seen) > self.options.max_list_items:
                raise _BadList(f"the list passed {self.options.max_list_items} objects")
            old = self._objects.get(key)
            self._objects[key] = now = (meta_version(item), meta_uid(item))
            # resourceVersions alone can repeat across a storage loss (see above)
            if old != now:
                self._emit("ADDED" if old is None else "MODIFIED", key, item)
        return count

    def _list_done(self, seen: set[ObjectKey], unkeyed: _Tally, list_rv: str,
                   since: str, pages: int) -> None:
        """After a list's last page: what it no longer holds is deleted; the revision it
        was read at is ours."""
        for key in [k for k in self._objects if k not in seen]:
            del self._objects[key]
            self._emit("DELETED", key, None)
        if unkeyed.count:
            log.warning("list of %s: %d objects without a usable namespace/name (the "
                        "first: %s); objects passed on to be recorded as skipped, other "
                        "items dropped", self.resource, unkeyed.count, unkeyed.first,
                        extra=self._extra(unkeyed=unkeyed.count))
        if _older(list_rv, self._reached) and not self._lower_explained:
            self.stats.went_back += 1
            log.warning("list of %s at revision %s, below the %s we had reached: the "
                        "server's storage went back (restored or lost?); its list is the "
                        "truth now", self.resource, list_rv, self._reached,
                        extra=self._extra(server_resource_version=list_rv))
        self._lower_explained = False
        self.resource_version = self._reached = list_rv
        if self.stats.lists:
            self.stats.relists += 1
        self.stats.lists += 1
        self._backoff.reset()
        if not self.synced.is_set():
            log.info("initial list done", extra={"resource": str(self.resource),
                                                 "objects": len(self._objects),
                                                 "resource_version": list_rv,
                                                 "pages": pages,
                                                 "list_from": since or "storage"})
        self.synced.set()

    # --- watch -----------------------------------------------------------------------

    async def _watch(self) -> None:
        opts = self.options
        timeout = max(1, int(opts.min_watch_timeout * (1 + random.random())))
        query = {
            "watch": "1",
            "resourceVersion": self.resource_version or "",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout),
            **self._selectors(),
        }
        loop = asyncio.get_running_loop()
        grace = min(WATCH_GRACE, timeout)
        # The stream is ended by us at timeout + grace; the client's own limit is later
        # still, so that ours is the one that fires.
        resp = await open_watch(self.api, self.resource, query, opts.request_timeout,
                                timeout + grace + 30)
        self.stats.watches += 1
        started = loop.time()
        stream = WatchStream(resp, started + timeout + grace, opts.stall_timeout,
                             opts.max_line_bytes, self._oversized)
        tally = stream.tally
        try:
            try:
                async for kind, obj in stream.events():
                    self._apply(kind, obj)
            except _Overdue:
                self.stats.overdue += 1
                log.warning("the server kept the watch of %s open %.0fs, past the "
                            "timeoutSeconds=%d we asked for (%d events, %d bookmarks); "
                            "ended it, watching again", self.resource,
                            loop.time() - started, timeout, tally.events, tally.bookmarks,
                            extra=self._extra())
                return
            if not tally.lines and loop.time() - started < SHORT_WATCH_SECONDS:
                raise _ShortWatch("the stream ended at once with nothing delivered")
            self.stats.watch_restarts += 1  # the server ended the stream (timeoutSeconds)
        finally:
            resp.close()
            if tally.heard:  # the server is talking
                self._stalls_in_a_row = 0
            if tally.oversized > 1:
                log.error("%d watch events over %d bytes skipped in one stream of %s",
                          tally.oversized, opts.max_line_bytes, self.resource,
                          extra=self._extra())

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        """A watch event (watch_stream.py decoded it): the objects we know and the
        revision we resume from follow it, and the handler hears of it."""
        rv = meta_version(obj)
        if _older(rv, self.resource_version):
            key = object_key(obj)
            what = "a bookmark" if kind == "BOOKMARK" else f"{kind} {key[0]}/{key[1]}"
            raise _WentBack(f"{what} at resourceVersion {rv} after {self.resource_version}")
        self._backoff.reset()
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            self.resource_version = rv or self.resource_version
            return
        key, named = self._key(obj)
        if not named:
            log.warning("%s event of %s without a usable namespace/name (%s): passed on "
                        "as %s to be recorded as skipped", kind, self.resource,
                        _why_unkeyed(obj), key[1], extra=self._extra(object=key[1]))
        if kind == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = (rv, meta_uid(obj))
        if rv:
            self.resource_version = rv
        self._emit(kind, key, obj)

    def _oversized(self, head: bytes, nth: int) -> None:
        """A watch line crossed max_line_bytes, the `nth` in its stream: the first is
        logged now, more are summed up in one line when the stream ends."""
        self.stats.oversized += 1
        if nth == 1:
            log.error("watch event of %s over %d bytes: skipping it", self.resource,
                      self.options.max_line_bytes,
                      extra=self._extra(object=identify_head(head)))

    def _key(self, obj: dict[str, Any]) -> tuple[ObjectKey, bool]:
        """The key an object of a list or a watch is kept under (one key whichever way
        it came), and whether it is the object's own namespace and name. One without a
        usable name gets a key of its own, counted. List items carry no kind/apiVersion;
        the decoder needs both."""
        obj.setdefault("kind", self.resource.kind)
        obj.setdefault("apiVersion", self.resource.api_version)
        found = identify(obj)
        if found is None:
            self.stats.unkeyed += 1
            return unkeyed_key(obj), False
        return found, True

    def _emit(self, kind: str, key: ObjectKey, obj: dict[str, Any] | None) -> None:
        self.stats.events += 1
        try:
            self.handler(WatchEvent(kind, self.resource, key[0], key[1], obj))
        except Exception:  # a bug downstream must not stop the watch
            log.exception("event handler failed", extra={"resource": str(self.resource),
                                                          "object": f"{key[0]}/{key[1]}"})


@dataclass(slots=True)
class _Tally:
    """How many odd items one list held, and the first, for its one log line."""

    count: int = 0
    first: str = ""

    def note(self, why: str) -> None:
        self.count += 1
        self.first = self.first or why


def _why_unkeyed(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return "metadata missing" if meta is None else f"metadata {shown(meta)}"
    return (f"metadata.name {shown(meta.get('name'))}, "
            f"metadata.namespace {shown(meta.get('namespace'))}")
