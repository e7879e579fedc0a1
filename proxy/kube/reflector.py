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
* a list response body over `max_list_bytes`, a paged list past `max_list_pages` pages
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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import re
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.kube.client import Api, BodyTooLarge, Response, read_body
from proxy.kube.identity import ObjectKey, decimal, meta_uid, meta_version, object_key, unkeyed_key
from proxy.kube.identity import key as identify
from proxy.kube.listsplit import ItemStream, TooLarge
from proxy.kube.resources import Resource
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
    max_list_bytes: int = 256 * 2**20  # one list response's body
    max_list_pages: int = 10_000
    max_list_items: int = 1_000_000


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


class _Overdue(Exception):
    """The stream outlived the timeoutSeconds we asked for, and its grace."""


class _WentBack(Exception):
    """A watch event or bookmark older than the revision we resume from."""


class _BadList(Exception):
    """A list that would not end (too large, too many pages or objects, or repeating)."""


# A stream that ends sooner than this having delivered nothing is treated as an error.
SHORT_WATCH_SECONDS = 1.0
# How long past its timeoutSeconds (this, or the timeout itself if shorter) a stream may
# stay open before we end it: the server ignores the timeout we asked for.
WATCH_GRACE = 30.0
# List items handled between turns of the event loop while the body is arriving (each
# ~5-50 us): the reader task takes in what has arrived meanwhile.
LIST_BATCH = 32
# Lines handled between yields to the event loop: a stream arriving faster than we handle
# it keeps the socket's buffer full, and reads that find data never yield.
YIELD_EVERY = 100
# A forced relist (410, revisions going back) longer than this after the previous one is
# immediate; sooner, it backs off (client-go resets its backoff after 2 minutes).
RELIST_QUIET = 120.0
# The start of an error answer's body is all a log line needs.
ERROR_BODY_BYTES = 64 * 1024
# Consecutive silent streams after which we ask whether the server is still the one whose
# revisions we follow (see _check_server_revision).
STALLS_BEFORE_PROBE = 2


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


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _older(rv: str, than: str | None) -> bool:
    """rv is a revision before `than`. resourceVersions are opaque to clients, but etcd's
    are integers and every server we know uses them; anything else cannot be judged and
    is taken as it comes."""
    mine, theirs = decimal(rv), decimal(than)
    return mine is not None and theirs is not None and mine < theirs


def _in(delay: float) -> str:
    return f" in {delay:.2f}s" if delay else ""


@dataclass(slots=True)
class _StreamTally:
    """What one watch stream delivered, for the log line that ends it."""

    lines: int = 0
    events: int = 0
    bookmarks: int = 0
    oversized: int = 0


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
        self._stream = _StreamTally()

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
                listing = self.resource_version is None
                self.stats.expired += 1
                if listing:
                    # The continue token (or the revision asked for) is gone: one
                    # unpaged consistent list, as client-go's pager falls back to.
                    self._unpaged_next = True
                    self._list_from = ""
                delay = self._relist_delay()
                log.info("%s; listing again%s", "the list's continue token expired (410 Gone)"
                         if listing else "watch history expired (410 Gone)", _in(delay),
                         extra=self._extra())
                self._forget_revision()
                await asyncio.sleep(delay)
            except _WentBack as exc:
                self.stats.went_back += 1
                delay = self._relist_delay()
                log.warning("watch of %s went back in time: %s; listing again%s",
                            self.resource, exc, _in(delay), extra=self._extra())
                self._forget_revision(explained=True)
                await asyncio.sleep(delay)
            except _Stalled:
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
            except Exception as exc:  # network, HTTP and parse errors alike: back off, retry
                listing = self.resource_version is None
                self.stats.errors += 1
                if isinstance(exc, _ShortWatch):
                    self.stats.short_watches += 1
                if isinstance(exc, _BadList):
                    self.stats.bad_lists += 1
                if listing and isinstance(exc, _HttpError) and exc.status == 504 and \
                        self._list_from not in ("", "0"):
                    # "Too large resource version": the server is behind the revision
                    # we had reached (its storage went back); only etcd can say where.
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
                await asyncio.sleep(delay)

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
        body = await self._get_json({**self._selectors(), "limit": "1"},
                                    self.options.request_timeout)
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
        seen: set[ObjectKey] = set()
        unkeyed = _Tally()  # objects without a usable name, for one log line
        token: str | None = None
        unpaged, self._unpaged_next = self._unpaged_next, False
        since = self._list_from
        # Paging only where it spares the server: a list from a revision of ours with a
        # limit would be a read from etcd (the cache cannot continue), without one the
        # cache answers. "0" keeps the limit: the cache ignores it, etcd pages.
        unpaged = unpaged or since not in ("", "0")
        opts = self.options
        pages = 0
        while True:
            query = self._selectors()
            if not unpaged:
                query["limit"] = str(opts.page_size)
            if token:
                query["continue"] = token  # no resourceVersion beside it: refused
            elif since:
                query["resourceVersion"] = since
            pages += 1
            head = await self._list_page(query, seen, unkeyed, pages)
            token = _continue_token(head)
            if token is None:
                break
            if pages >= opts.max_list_pages:
                raise _BadList(f"the list did not end after {pages} pages")
        self._list_done(seen, unkeyed, meta_version(head), since, pages)

    async def _list_page(self, query: dict[str, str], seen: set[ObjectKey], unkeyed: _Tally,
                         page: int) -> dict[str, Any]:
        """Ask for one page of a list and pass on what it added or changed as its items
        arrive (listsplit.py: each parsed, decoded and dropped as soon as its end has
        arrived, while the server is still writing the rest); `seen` gathers the keys.
        The list's head (its metadata) is returned once the body has all arrived.

        A task of its own takes the body in as fast as it comes, and the items are
        handled in batches between which it runs: the server's answer leaves its memory
        at the network's pace, not ours (5,000 agents list at once in a rollout).

        The whole answer must come within request_timeout, as any request's: the time
        we spend on its items meanwhile does not count (up to request_timeout of it;
        past that, the rest of the body is read first and its items taken after)."""
        opts = self.options
        listing = ItemStream(opts.max_list_bytes)
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()
        timer = asyncio.timeout(opts.request_timeout)
        checked = False

        async def receive() -> None:
            try:
                async with timer:
                    # The client's own limit: later than ours can be with our time added.
                    resp = await self.api.get(self.resource.path, query,
                                              2 * opts.request_timeout + 5)
                    try:
                        await _check_status(resp)
                        while chunk := await resp.readany():
                            try:
                                listing.feed(chunk)
                            except TooLarge:
                                raise _BadList("a list response over "
                                               f"{opts.max_list_bytes} bytes") from None
                            arrived.set()
                    finally:
                        resp.close()
            except TimeoutError:
                if not timer.expired():
                    raise
                raise TimeoutError(f"no whole answer within {opts.request_timeout:g}s"
                                   ) from None
            finally:
                arrived.set()

        def take(most: int | None = None) -> int:
            nonlocal checked
            if not checked and listing.head is not None:
                _check_head(listing.head)
                checked = True
            return self._pass_on(itertools.islice(listing.take(), most), seen, unkeyed,
                                 page)

        reader = asyncio.create_task(receive(), name=f"list {self.resource}")
        spent = 0.0  # on items, while the body was arriving
        try:
            while not reader.done():
                await arrived.wait()
                arrived.clear()
                while spent < opts.request_timeout and not reader.done():
                    began = loop.time()
                    taken = take(LIST_BATCH)
                    took = loop.time() - began
                    spent += took
                    when = timer.when()
                    if when is not None:
                        timer.reschedule(when + took)
                    if taken < LIST_BATCH:
                        break
                    await asyncio.sleep(0)  # the reader takes in what has arrived
            await reader  # its error, if it failed
        finally:
            if not reader.done():
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
        listing.close()  # parses whatever was not cut (outside the timer, as ever)
        take()
        assert listing.head is not None
        return listing.head

    def _pass_on(self, items: Iterator[Any], seen: set[ObjectKey], unkeyed: _Tally,
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

    async def _get_json(self, query: dict[str, str], timeout: float) -> dict[str, Any]:
        body = orjson.loads(await self._get_body(query, timeout))
        if not isinstance(body, dict):
            raise _HttpError(200, "list response is not an object")
        return body

    async def _get_body(self, query: dict[str, str], timeout: float) -> bytearray:
        # The whole answer, body included, within the timeout: a body trickling forever
        # must not hold the loop. The client's own limit is a little later, so that ours
        # is the one that fires (and says what happened).
        timer = asyncio.timeout(timeout)
        try:
            async with timer:
                resp = await self.api.get(self.resource.path, query, timeout + 5)
                try:
                    await _check_status(resp)
                    try:
                        data = await read_body(resp, self.options.max_list_bytes)
                    except BodyTooLarge:
                        raise _BadList(f"a list response over {self.options.max_list_bytes}"
                                       " bytes") from None
                finally:
                    resp.close()
        except TimeoutError:
            if not timer.expired():
                raise
            raise TimeoutError(f"no whole answer within {timeout:g}s") from None
        return data

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
        grace = min(WATCH_GRACE, timeout)
        # The answer to the request itself must come within request_timeout like any
        # other; the stream is ended by us at timeout + grace (the client's own limit is
        # later still, so that ours is the one that fires).
        timer = asyncio.timeout(self.options.request_timeout)
        try:
            async with timer:
                resp = await self.api.get(self.resource.path, query, timeout + grace + 30)
        except TimeoutError:
            if not timer.expired():
                raise
            raise TimeoutError(f"no answer within {self.options.request_timeout:g}s") from None
        try:
            if resp.status == 410:
                raise _Gone()
            if resp.status != 200:
                data = await read_body(resp, ERROR_BODY_BYTES, truncate=True)
                raise _HttpError(resp.status, _status_message(data), _retry_after(resp.headers))
            self.stats.watches += 1
            started = loop.time()
            tally = self._stream = _StreamTally()
            try:
                async for line in self._lines(resp, started + timeout + grace):
                    tally.lines += 1
                    self._handle_line(line)
                    if tally.lines % YIELD_EVERY == 0:
                        await asyncio.sleep(0)
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
            if self._stream.oversized > 1:
                log.error("%d watch events over %d bytes skipped in one stream of %s",
                          self._stream.oversized, self.options.max_line_bytes,
                          self.resource, extra=self._extra())
            self._stream = _StreamTally()

    def _handle_line(self, line: bytes | bytearray) -> None:
        event = orjson.loads(line)
        kind = event.get("type")
        obj = event.get("object")
        if not isinstance(obj, dict):
            raise ValueError(f"watch event without an object: {line[:200]!r}")
        if kind == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise _Gone()
            raise _HttpError(int(code or 0), str(obj.get("message") or obj))
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            raise ValueError(f"unknown watch event type {kind!r}")
        rv = meta_version(obj)
        if _older(rv, self.resource_version):
            key = object_key(obj)
            what = "a bookmark" if kind == "BOOKMARK" else f"{kind} {key[0]}/{key[1]}"
            raise _WentBack(f"{what} at resourceVersion {rv} after {self.resource_version}")
        self._backoff.reset()
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            self._stream.bookmarks += 1
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
        self._stream.events += 1
        self._emit(kind, key, obj)

    async def _lines(self, resp: Response, deadline: float) -> AsyncIterator[bytearray]:
        """JSON lines of a watch stream; raises _Stalled when it goes quiet, _Overdue at
        `deadline` (loop time).

        A line longer than `max_line_bytes` is dropped as it streams by (never held
        whole), counted and logged as soon as it crosses the bound (a line that never
        ends is still told): no real API server sends objects that big (etcd refuses
        them), so it comes from a broken or hostile server.

        The line yielded is the buffer itself, valid until the next line is asked for
        (no copy); pieces of chunks are appended through memoryviews (no copy either).
        """
        loop = asyncio.get_running_loop()
        buf = bytearray()
        discarding = False
        limit = self.options.max_line_bytes
        while True:
            timer = asyncio.timeout_at(min(loop.time() + self.options.stall_timeout, deadline))
            try:
                async with timer:
                    chunk = await resp.readany()
            except TimeoutError:
                if not timer.expired():  # the client's own timeout: an error like any other
                    raise
                if loop.time() >= deadline:
                    raise _Overdue() from None
                raise _Stalled() from None
            if not chunk:
                return
            if loop.time() >= deadline:  # a stream that always has data never times out
                raise _Overdue()
            self._stalls_in_a_row = 0  # the server is talking
            start = 0
            while True:
                nl = chunk.find(b"\n", start)
                end = len(chunk) if nl < 0 else nl
                if not discarding and len(buf) + end - start > limit:
                    discarding = True
                    self._oversized(bytes(buf[:_HEAD]) + chunk[start:start + _HEAD])
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
                        yield buf
                buf.clear()
                start = nl + 1

    def _oversized(self, head: bytes) -> None:
        """A line crossed max_line_bytes: the first in a stream is logged now, more are
        summed up in one line when the stream ends."""
        self.stats.oversized += 1
        self._stream.oversized += 1
        if self._stream.oversized == 1:
            log.error("watch event of %s over %d bytes: skipping it", self.resource,
                      self.options.max_line_bytes,
                      extra=self._extra(object=_identify(head)))

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


async def _check_status(resp: Response) -> None:
    """Raise for a list answer that is not 200."""
    if resp.status == 410:
        # An expired continue token: the snapshot is gone; list again.
        raise _Gone()
    if resp.status != 200:
        data = await read_body(resp, ERROR_BODY_BYTES, truncate=True)
        raise _HttpError(resp.status, _status_message(data), _retry_after(resp.headers))


def _check_head(head: dict[str, Any]) -> None:
    items, meta = head.get("items"), head.get("metadata")
    if not isinstance(items, list | None) or not isinstance(meta, dict | None):
        raise _BadList("a list whose items or metadata have the wrong type")


def _continue_token(head: dict[str, Any]) -> str | None:
    """The token for a list's next page; None after the last."""
    # Read from the head after the items: had they not been cut cleanly, the head is the
    # whole body's now (listsplit.ItemStream).
    meta = head.get("metadata")
    if not isinstance(meta, dict | None):
        raise _BadList("a list whose metadata has the wrong type")
    token = (meta or {}).get("continue") or None
    if token is not None and not isinstance(token, str):
        raise _BadList(f"a continue token that is no string: {shown(token)}")
    return token


def _why_unkeyed(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return "metadata missing" if meta is None else f"metadata {shown(meta)}"
    return (f"metadata.name {shown(meta.get('name'))}, "
            f"metadata.namespace {shown(meta.get('namespace'))}")


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


def _status_message(data: bytes | bytearray) -> str:
    try:
        status = orjson.loads(data)
        if isinstance(status, dict) and status.get("message"):
            return str(status["message"])
    except orjson.JSONDecodeError:
        pass
    return data[:200].decode("utf-8", "replace")

