"""A lying or hostile API server (issue 13): the real reflector, through the real client
(KubeApi on `kubernetes.aio`, configured from a kubeconfig), against an in-process
aiohttp server that misbehaves in one way per test, then behaves again.

Every test checks the same four things:

* memory: the peak of Python allocations (tracemalloc) while the server misbehaves —
  client and server together, both run in this process — stays under the bound in the
  test's name. Python allocations, not RSS: the same figure on every machine; the bytes
  that cross the socket are Python objects on both sides, so nothing large escapes it;
* the log: one line per incident naming the resource and what was wrong (counted
  against the reflector's own counters), never one per event;
* the reflector's task is still running, and once the server behaves again it converges
  on the server's objects (polled with a deadline, never a sleep used as synchronisation);
* each hostile loop is bounded: the server misbehaves for a bounded number of incidents
  (then the test makes it behave), every wait has a deadline, and the whole test runs
  under `asyncio.timeout(LIMIT)`. No assertion depends on wall-clock speed: the only
  times asserted are lower bounds on backoff delays, which sleeping guarantees.

Measured peaks on the machine these were written on (2 shared cores) are in
docs/watch.md next to each bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web

from proxy.agent.logs import LogfmtFormatter
from proxy.kube.client import ClientOptions, KubeApi
from proxy.kube.reflector import Reflector, ReflectorOptions, WatchEvent
from proxy.kube.resources import SERVICES
from proxy.kube.watch_stream import YIELD_EVERY
from proxy.sim.harness import kubeconfig
from tests.integration.watchkit import GatedApi, eventually, run

MiB = 2**20
GiB = 2**30
LIMIT = 120.0  # seconds: the deadline of a whole test (generous: a loaded machine)

# Small bounds so that each incident comes quickly; the same code paths as production.
# A watch asks for timeoutSeconds=1, so a stream the server will not end is ended by us
# at 1 + 1 s.
OPTIONS = ReflectorOptions(page_size=50, min_watch_timeout=1, request_timeout=5,
                           stall_timeout=5, backoff_initial=0.05, backoff_max=0.4,
                           max_line_bytes=1 * MiB, max_list_bytes=4 * MiB,
                           max_list_pages=40, max_list_items=1000)

Obj = dict[str, Any]
Writer = Callable[[web.StreamResponse, int], Awaitable[None]]


def service(name: str, rv: int) -> Obj:
    return {"kind": "Service", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}",
                         "resourceVersion": str(rv)},
            "spec": {"ports": [{"port": 80}]}}


def line(kind: str, obj: Obj) -> bytes:
    return orjson.dumps({"type": kind, "object": obj}) + b"\n"


GONE = line("ERROR", {"kind": "Status", "apiVersion": "v1", "code": 410, "reason": "Expired",
                      "message": "too old resource version"})


class Server:
    """Services held in memory and served the way the API server does: a list at the
    current revision (one page, whatever the limit), watches that send the changes
    after their start and end at timeoutSeconds, or answer 410 if their start is
    before `floor` (history compacted). `lists` and `watches`, when set, replace the
    answer with a misbehaving one, counted in `hostile_lists` and `hostile_watches`."""

    def __init__(self) -> None:
        self.rv = 100
        self.floor = 0
        self.objects: dict[str, Obj] = {}
        self.changes: list[tuple[int, bytes]] = []  # (revision, the event's line)
        self._wake = asyncio.Event()
        self.lists: Callable[[web.Request], Awaitable[web.StreamResponse]] | None = None
        self.watches: Writer | None = None
        self.hostile_lists = 0
        self.hostile_watches = 0
        self.junk: list[Any] = []  # list items served after the objects, as they are
        self.url = ""
        self._runner: web.AppRunner | None = None

    def put(self, name: str) -> Obj:
        """Create or change a service, as a write to the API server would."""
        self.rv += 1
        kind = "MODIFIED" if name in self.objects else "ADDED"
        self.objects[name] = obj = service(name, self.rv)
        self.changes.append((self.rv, line(kind, obj)))
        self._wake.set()
        self._wake = asyncio.Event()
        return obj

    def keys(self) -> dict[tuple[str, str], str]:
        return {("default", n): o["metadata"]["resourceVersion"]
                for n, o in self.objects.items()}

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/services", self._services)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _services(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") != "1":
            if self.lists is not None:
                self.hostile_lists += 1
                return await self.lists(request)
            return web.json_response({
                "kind": "ServiceList", "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": [*self.objects.values(), *self.junk]})
        start = int(request.query.get("resourceVersion") or self.rv)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        # The client going away is how every endless answer ends.
        with contextlib.suppress(ConnectionError):
            if self.watches is not None:
                self.hostile_watches += 1
                await self.watches(resp, start)
            elif start < self.floor:
                await resp.write(GONE)
            else:
                await self._watch(resp, start, int(request.query["timeoutSeconds"]))
        return resp

    async def _watch(self, resp: web.StreamResponse, start: int, timeout: int) -> None:
        loop = asyncio.get_running_loop()
        deadline, sent = loop.time() + timeout, start
        while True:
            for rv, data in self.changes:
                if rv > sent:
                    await resp.write(data)
                    sent = rv
            wake = self._wake
            try:
                async with asyncio.timeout_at(deadline):
                    await wake.wait()
            except TimeoutError:
                # As the watch cache does before a timeout: a bookmark, so that a quiet
                # one-second stream is no "very short watch" (an error, backed off).
                if self.rv >= sent:
                    await resp.write(line("BOOKMARK", {
                        "kind": "Service", "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(self.rv)}}))
                return


# ---- the test's side: the reflector, what it logged, what it cost -------------------


@dataclass
class Tally:
    """A handler that keeps the last object per key and counts: bounded, unlike a
    recorder of every event, so that a flood measures the reflector, not the test."""

    objects: dict[tuple[str, str], Obj | None]
    events: int = 0

    def __call__(self, ev: WatchEvent) -> None:
        self.events += 1
        if ev.type == "DELETED":
            self.objects.pop((ev.namespace, ev.name), None)
        else:
            self.objects[(ev.namespace, ev.name)] = ev.obj

    def keys(self) -> dict[tuple[str, str], str]:
        return {k: str(((o or {}).get("metadata") or {}).get("resourceVersion"))
                for k, o in self.objects.items()}


@contextlib.contextmanager
def peak_memory() -> Iterator[list[int]]:
    """The peak of Python allocations made inside the block, in bytes (out[0] after)."""
    out: list[int] = []
    tracemalloc.start()
    try:
        yield out
    finally:
        out.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


class Ticker:
    """Another task on the loop: the most lines (events and bookmarks) the reflector
    handled between two of its turns. A reflector that never yields starves it."""

    def __init__(self, reflector: Reflector) -> None:
        self.reflector = reflector
        self.max_gap = 0
        self.turns = 0

    def _lines(self) -> int:
        return self.reflector.stats.events + self.reflector.stats.bookmarks

    async def run(self) -> None:
        last = self._lines()
        while True:
            await asyncio.sleep(0)
            now = self._lines()
            self.max_gap, last = max(self.max_gap, now - last), now
            self.turns += 1


class Harness:
    def __init__(self, tmp: Path, options: ReflectorOptions = OPTIONS) -> None:
        self.tmp, self.options = tmp, options
        self.server = Server()
        self.tally = Tally({})

    async def __aenter__(self) -> Harness:
        await self.server.start()
        path = self.tmp / "kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig(self.server.url)), encoding="utf-8")
        self.api = GatedApi(await KubeApi.connect(ClientOptions(kubeconfig=str(path))))
        self.reflector = Reflector(self.api, SERVICES, self.tally, self.options)
        self.task = asyncio.create_task(self.reflector.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.api.close()
        await self.server.stop()

    async def synced(self) -> None:
        await eventually(self.reflector.synced.is_set, what="the first list")

    async def converged(self, what: str = "reflector equals server") -> None:
        """The reflector and the handler hold exactly the server's services, and the
        reflector is still running."""
        def same() -> bool:
            want = self.server.keys()
            return dict(self.reflector.known) == want and self.tally.keys() == want

        await eventually(same, timeout=30, what=what, detail=lambda: (
            self.reflector.stats, self.reflector.resource_version, self.server.rv,
            sorted(self.reflector.known)[:5], sorted(self.server.objects)[:5]))
        assert not self.task.done()

    def alive(self) -> None:
        assert not self.task.done(), self.task


def logged(caplog: pytest.LogCaptureFixture, fragment: str) -> list[str]:
    """The reflector's lines holding `fragment`, as the agent prints them (message and
    keys: a failed request's error is a key, not part of the message)."""
    lines = [LINE.format(r) for r in caplog.records if r.name == "proxy.kube.reflector"]
    return [line for line in lines if fragment in line]


LINE = LogfmtFormatter()


def bounded(main: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    async def limited() -> None:
        async with asyncio.timeout(LIMIT):
            await main()

    return limited


@pytest.fixture(autouse=True)
def _warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="proxy.kube.reflector")


# ---- endless watch streams ----------------------------------------------------------


FLOOD_NAMES = 10


def flood_of_events(server: Server) -> Writer:
    """MODIFIED events for ten services, as fast as the socket takes them, forever; the
    server's state follows, and its history is compacted as it goes (a watch resumed
    from before is answered 410, as a real server's would be)."""
    async def write(resp: web.StreamResponse, start: int) -> None:
        while server.watches is write:  # until the test makes the server behave
            batch = bytearray()
            for _ in range(200):
                server.rv += 1
                obj = service(f"flood-{server.rv % FLOOD_NAMES}", server.rv)
                server.objects[obj["metadata"]["name"]] = obj
                batch += line("MODIFIED", obj)
            server.floor = server.rv
            await resp.write(bytes(batch))

    return write


def flood_of_bookmarks(server: Server) -> Writer:
    """Valid bookmarks and nothing else, as fast as the socket takes them, forever (the
    revision moves on, as other resources' writes move etcd's)."""
    async def write(resp: web.StreamResponse, start: int) -> None:
        while server.watches is write:  # until the test makes the server behave
            batch = bytearray()
            for _ in range(200):
                server.rv += 1
                batch += line("BOOKMARK", {"kind": "Service", "apiVersion": "v1",
                                           "metadata": {"resourceVersion": str(server.rv)}})
            await resp.write(bytes(batch))

    return write


@pytest.mark.parametrize("flood", ["events", "bookmarks"])
def test_endless_stream_is_ended_past_its_timeout_under_16MiB(tmp_path: Path, flood: str,
                                                             caplog: pytest.LogCaptureFixture,
                                                             ) -> None:
    """A stream the server never ends (events for ten objects, or bookmarks, as fast as
    it can) is ended by the reflector at timeoutSeconds + grace, logged once per stream;
    the loop yields to other tasks every YIELD_EVERY lines; memory stays flat (16 MiB)."""
    @bounded
    async def main() -> None:
        async with Harness(tmp_path) as h:
            for i in range(3):
                h.server.put(f"s{i}")
            await h.synced()
            ticker = Ticker(h.reflector)
            tick = asyncio.create_task(ticker.run())
            writer = flood_of_events if flood == "events" else flood_of_bookmarks
            with peak_memory() as peak:
                h.server.watches = writer(h.server)
                await eventually(lambda: h.reflector.stats.overdue >= 2, timeout=60,
                                 what="two streams ended by the reflector")
                h.server.watches = None
            tick.cancel()
            stats = h.reflector.stats
            lines = stats.events if flood == "events" else stats.bookmarks
            assert lines > 10 * YIELD_EVERY, stats  # a flood indeed
            assert ticker.max_gap <= YIELD_EVERY, (ticker.max_gap, ticker.turns)
            assert peak[0] < 16 * MiB, peak
            overdue = logged(caplog, "past the timeoutSeconds=1 we asked for")
            assert len(overdue) == stats.overdue and "services.v1" in overdue[0], overdue
            # The only error allowed is the fake server's own: under load its swap of
            # writers can end one stream at once with nothing sent (a short watch).
            assert stats.errors == stats.short_watches, stats
            h.alive()
            h.server.put("after")
            await h.converged()
            print(f"\n{flood}: {lines} lines, peak {peak[0] / MiB:.1f} MiB, "
                  f"{stats.overdue} streams ended by us, max gap {ticker.max_gap}")

    run(main)


# ---- one event larger than memory would allow -----------------------------------------


HUGE = 4 * GiB
WRITE = 256 * 1024  # the server's writes: its own buffers stay small, measuring ours


def one_huge_event(server: Server, size: int) -> Writer:
    """One ADDED event of `size` bytes (a single JSON line, streamed), then behave."""
    async def write(resp: web.StreamResponse, start: int) -> None:
        server.rv += 1
        head = orjson.dumps({"type": "ADDED", "object": {
            "kind": "Service", "apiVersion": "v1",
            "metadata": {"name": "huge", "namespace": "default",
                         "resourceVersion": str(server.rv)}}})
        await resp.write(head[:-2] + b',"blob":"')  # inside the object, a string
        chunk = b"x" * WRITE
        for _ in range(size // WRITE):
            await resp.write(chunk)
        await resp.write(b'"}}\n')
        server.watches = None  # the rest of this stream, and the next, behave
        await server._watch(resp, start, 1)

    return write


def test_a_4GiB_event_is_skipped_as_it_streams_by_under_8MiB(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A single 4 GiB JSON line is dropped as it streams by, never buffered whole: peak
    under 8 MiB with max_line_bytes 1 MiB (a line is held up to the bound, then dropped).
    One log line names the object; the stream goes on and delivers the next event."""
    # Streams that may last a minute: the line takes seconds to cross the socket.
    options = replace(OPTIONS, min_watch_timeout=60)

    @bounded
    async def main() -> None:
        async with Harness(tmp_path, options) as h:
            h.server.put("s0")
            with peak_memory() as peak:
                h.server.watches = one_huge_event(h.server, HUGE)  # the first watch
                await h.synced()
                await eventually(lambda: h.server.hostile_watches == 1,
                                 what="the huge event sent")
                h.server.put("after")
                await h.converged("the event after the huge one delivered")
            stats = h.reflector.stats
            assert stats.oversized == 1 and stats.errors == 0, stats
            assert peak[0] < 8 * MiB, peak
            (msg,) = logged(caplog, "over 1048576 bytes")
            assert "services.v1" in msg, msg
            record = next(r for r in caplog.records if "over 1048576 bytes" in r.getMessage())
            assert record.__dict__["object"] == "default/huge"
            assert ("default", "huge") not in h.reflector.known
            print(f"\n4 GiB line: peak {peak[0] / MiB:.1f} MiB")

    run(main)


def test_a_line_without_end_is_dropped_and_its_stream_ended_under_8MiB(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A line that never ends: told as soon as it crosses the bound (not when it ends,
    which it never does), its stream ended at timeoutSeconds + grace; 8 MiB."""
    async def endless_line(resp: web.StreamResponse, start: int) -> None:
        await resp.write(b'{"type":"ADDED","object":{"metadata":{"name":"endless","names'
                         b'pace":"default"},"blob":"')
        chunk = b"y" * WRITE
        while True:
            await resp.write(chunk)

    @bounded
    async def main() -> None:
        async with Harness(tmp_path) as h:
            h.server.put("s0")
            await h.synced()
            with peak_memory() as peak:
                h.server.watches = endless_line
                await eventually(lambda: h.reflector.stats.overdue >= 1, timeout=60,
                                 what="the stream ended by the reflector")
                h.server.watches = None
            assert peak[0] < 8 * MiB, peak
            stats = h.reflector.stats
            assert len(logged(caplog, "over 1048576 bytes: skipping it")) == stats.oversized
            assert len(logged(caplog, "past the timeoutSeconds")) == stats.overdue
            h.server.put("after")
            await h.converged()
            print(f"\nendless line: peak {peak[0] / MiB:.1f} MiB")

    run(main)


# ---- lists that never end -----------------------------------------------------------


async def endless_list_body(request: web.Request) -> web.StreamResponse:
    """A list whose body never ends: the same item, as fast as the socket takes them,
    laid out as kube-apiserver writes items (metadata first: cut as they arrive)."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    obj = service("x", 1)
    item = orjson.dumps({"metadata": obj.pop("metadata"), **obj}) + b","
    with contextlib.suppress(ConnectionError):
        await resp.write(b'{"kind":"ServiceList","metadata":{"resourceVersion":"1"},"items":[')
        batch = item * 1000
        while True:
            await resp.write(batch)
    return resp


async def endless_list_item(request: web.Request) -> web.StreamResponse:
    """A list whose one item never ends (an annotation without end): nothing to cut."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    with contextlib.suppress(ConnectionError):
        await resp.write(b'{"kind":"ServiceList","metadata":{"resourceVersion":"1"},"items":['
                         b'{"metadata":{"name":"x","annotations":{"a":"')
        batch = b"a" * 65536
        while True:
            await resp.write(batch)
    return resp


async def trickling_list_body(request: web.Request) -> web.StreamResponse:
    """A list whose body never ends, a few bytes at a time: under every size bound."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    with contextlib.suppress(ConnectionError):
        await resp.write(b'{"kind":"ServiceList","metadata":{"resourceVersion":"1"},"items":[')
        while True:
            await resp.write(b" ")
            await asyncio.sleep(0.01)
    return resp


@pytest.mark.parametrize(("body", "said", "options"), [
    (endless_list_item, "over 4194304 bytes of a list response not cut into items",
     OPTIONS),
    (endless_list_body, "the list repeated default/x (page 1)", OPTIONS),
    (trickling_list_body, "no whole answer within 2s", replace(OPTIONS, request_timeout=2)),
], ids=["endless-item", "repeated-items", "trickle"])
def test_a_list_body_without_end_is_given_up_and_retried_under_16MiB(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        body: Callable[[web.Request], Awaitable[web.StreamResponse]], said: str,
        options: ReflectorOptions) -> None:
    """A list response streamed forever is given up: past max_list_bytes not cut into
    items (4 MiB here: peak under 16 MiB, that much held once and a bytearray's
    growth), at its first repeated item (items are taken as they arrive, their bytes
    dropped) or, trickling, at request_timeout; each attempt is one log line; retried
    with backoff."""
    @bounded
    async def main() -> None:
        async with Harness(tmp_path, options) as h:
            h.server.put("s0")
            with peak_memory() as peak:
                h.server.lists = body
                await eventually(lambda: h.reflector.stats.errors >= 2, timeout=60,
                                 what="two failed lists")
                h.server.lists = None
            assert peak[0] < 16 * MiB, peak
            stats = h.reflector.stats
            failed = logged(caplog, said)
            assert failed and len(failed) <= stats.errors, (failed, stats)
            assert 'msg="API request failed; retrying" request=list resource=services.v1' \
                in failed[0], failed
            await h.synced()
            await h.converged()
            print(f"\nlist body ({said}): peak {peak[0] / MiB:.1f} MiB, "
                  f"{stats.errors} attempts")

    run(main)


def pages(kind: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Paged lists whose continue tokens never end: new objects on every page, the same
    objects on every page, or empty pages."""
    async def answer(request: web.Request) -> web.StreamResponse:
        page = int(request.query.get("continue") or 0)
        limit = int(request.query.get("limit") or 50)
        names = {"new": [f"p{page}-{i}" for i in range(limit)],
                 "same": [f"p-{i}" for i in range(limit)], "empty": []}[kind]
        return web.json_response({
            "kind": "ServiceList", "apiVersion": "v1",
            "metadata": {"resourceVersion": "1", "continue": str(page + 1)},
            "items": [service(n, 1) for n in names]})

    return answer


@pytest.mark.parametrize(("kind", "said"), [
    ("new", "passed 1000 objects"),
    ("same", "repeated default/p-0 (page 2)"),
    ("empty", "did not end after 40 pages"),
])
def test_continue_tokens_without_end_are_given_up_under_16MiB(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, said: str) -> None:
    """A paged list whose `continue` never ends is given up at max_list_items (1,000
    here), at the first repeated object, or at max_list_pages (40 here); retried with
    backoff; the objects it delivered meanwhile are taken back by the next good list.
    16 MiB: at most max_list_items objects are held."""
    @bounded
    async def main() -> None:
        async with Harness(tmp_path) as h:
            h.server.put("s0")
            with peak_memory() as peak:
                h.server.lists = pages(kind)
                await eventually(lambda: h.reflector.stats.bad_lists >= 2, timeout=60,
                                 what="two lists given up")
                h.server.lists = None
            stats = h.reflector.stats
            assert peak[0] < 16 * MiB, peak
            told = logged(caplog, said)
            assert told and len(told) <= stats.errors, (told, stats)
            # No more requests than the bounds allow: each attempt stops at its bound.
            per_attempt = {"new": 1000 // 50 + 1, "same": 2, "empty": 40}[kind]
            assert h.server.hostile_lists <= stats.bad_lists * per_attempt + per_attempt
            await h.converged("the good list takes back what the endless one delivered")
            print(f"\npages ({kind}): peak {peak[0] / MiB:.1f} MiB, "
                  f"{h.server.hostile_lists} pages in {stats.bad_lists} attempts")

    run(main)


# ---- resourceVersions going backwards ------------------------------------------------


def backwards(server: Server, what: str) -> Writer:
    """One true change, then a line older than the watch's start (an event for an
    object we hold, or a bookmark); the stream stays open."""
    async def write(resp: web.StreamResponse, start: int) -> None:
        server.put("a")
        await resp.write(server.changes[-1][1])
        old = start - 5
        if what == "event":
            await resp.write(line("MODIFIED", service("b", old)))
        else:
            await resp.write(line("BOOKMARK", {"kind": "Service", "apiVersion": "v1",
                                               "metadata": {"resourceVersion": str(old)}}))
        await asyncio.Event().wait()  # open until the client goes

    return write


@pytest.mark.parametrize("what", ["event", "bookmark"])
def test_a_watch_going_back_relists_backing_off_under_4MiB(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, what: str) -> None:
    """A watch event (or bookmark) older than the revision we resume from ends the
    stream and relists: once at once, then with a growing delay when it happens again
    and again (no list per round trip); one log line per incident; the relist gives the
    truth, so no object ever goes back in time. 4 MiB."""
    @bounded
    async def main() -> None:
        async with Harness(tmp_path) as h:
            for name in ("a", "b", "c"):
                h.server.put(name)
            await h.synced()
            with peak_memory() as peak:
                h.server.watches = backwards(h.server, what)
                await eventually(lambda: h.reflector.stats.went_back >= 5, timeout=60,
                                 what="five watches that went back")
                h.server.watches = None
            assert peak[0] < 4 * MiB, peak
            stats = h.reflector.stats
            told = logged(caplog, "went back in time")
            assert len(told) == stats.went_back, (told, stats)
            kind = "a bookmark" if what == "bookmark" else "MODIFIED default/b"
            assert f"{kind} at resourceVersion " in told[0], told
            assert "services.v1" in told[0]
            # Relists: the first at once, then each at least half the backoff's ceiling.
            lists = [r.at for r in h.api.lists()][1:stats.went_back + 1]
            gaps = [b - a for a, b in itertools.pairwise(lists)]
            for n, gap in enumerate(gaps):
                assert gap >= min(OPTIONS.backoff_max, OPTIONS.backoff_initial * 2**n) / 2, gaps
            # b went back on the wire, never in what the reflector delivered.
            assert h.tally.keys()[("default", "b")] == h.server.keys()[("default", "b")]
            h.server.put("after")
            await h.converged()
            print(f"\nwent back ({what}): peak {peak[0] / MiB:.1f} MiB, gaps "
                  f"{[round(g, 2) for g in gaps]}")

    run(main)


def test_a_list_below_our_revision_is_the_truth_and_said_once_under_4MiB(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The server's storage goes back (a restore): its watch says 410, and its list is
    at a revision below the one we had reached, with older objects. The list is a
    consistent read, so it is taken as the truth — objects at their older revisions,
    those it lacks deleted — and said once. 4 MiB."""
    server: list[Server] = []

    async def gone(resp: web.StreamResponse, start: int) -> None:
        server[0].watches = None  # once: the watches after it behave
        await resp.write(GONE)

    @bounded
    async def main() -> None:
        async with Harness(tmp_path) as h:
            server.append(h.server)
            for name in ("a", "b", "c", "d"):
                h.server.put(name)
            await h.synced()
            reached = h.reflector.resource_version
            assert reached == str(h.server.rv)
            with peak_memory() as peak:
                # The backup: revision 50, "a" and "b" as they were then, no "c" or "d".
                s = h.server
                s.rv, s.changes = 50, []
                s.objects = {"a": service("a", 40), "b": service("b", 45)}
                s.watches = gone
                await eventually(lambda: h.reflector.stats.went_back >= 1,
                                 what="the list below ours")
                await h.converged("the restored state, older revisions and all")
            assert peak[0] < 4 * MiB, peak
            (told,) = logged(caplog, "below the")
            assert f"at revision 50, below the {reached} we had reached" in told, told
            # Polled: on a loaded machine the reflector may still be between its list
            # and its next watch when converged() sees the objects.
            await eventually(lambda: h.reflector.resource_version == "50",
                             what="the reflector at the restored revision")
            h.server.put("after")
            await h.converged()

    run(main)


def test_every_watch_answered_410_is_not_a_list_per_round_trip(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A server that answers every watch with 410 Gone: the first relist is immediate,
    the ones that follow back off (client-go backs off before every relist)."""
    async def gone(resp: web.StreamResponse, start: int) -> None:
        await resp.write(GONE)

    @bounded
    async def main() -> None:
        async with Harness(tmp_path, replace(OPTIONS, backoff_max=0.2)) as h:
            h.server.put("a")
            await h.synced()
            h.server.watches = gone
            await eventually(lambda: h.reflector.stats.expired >= 6, what="six 410s")
            h.server.watches = None
            lists = [r.at for r in h.api.lists()][1:7]
            gaps = [b - a for a, b in itertools.pairwise(lists)]
            for n, gap in enumerate(gaps):
                assert gap >= min(0.2, OPTIONS.backoff_initial * 2**n) / 2, gaps
            h.server.put("after")
            await h.converged()

    run(main)


# ---- objects without a usable identity -------------------------------------------------


NOT_OBJECTS: list[Any] = [7, "text", None, []]


def unkeyed() -> list[Obj]:
    """Objects the reflector cannot key by (namespace, name): metadata of the wrong type
    or missing, a name or namespace that is no string."""
    spec = {"ports": [{"port": 80}]}
    base = {"kind": "Service", "apiVersion": "v1", "spec": spec}
    return [
        {**base, "metadata": []},
        {**base, "metadata": "web"},
        {**base, "metadata": ["web", "default"]},
        {**base, "metadata": 7},
        {**base},
        {**base, "metadata": {"name": 5, "namespace": "default"}},
        {**base, "metadata": {"name": {"a": 1}, "namespace": "default"}},
        {**base, "metadata": {"name": "x", "namespace": ["default"]}},
        {**base, "metadata": {"name": ""}},
    ]


def odd_versions() -> Obj:
    """A service whose resourceVersion and uid are no strings: it is kept, its version
    unknown (never a resume point)."""
    obj = service("odd", 0)
    obj["metadata"]["resourceVersion"] = ["1"]
    obj["metadata"]["uid"] = {"u": 1}
    return obj


def test_objects_without_a_usable_name_are_passed_on_and_the_rest_listed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A list holding objects with metadata [] (or a string, a number, none; a name or
    namespace that is no string) and items that are no object: the rest of the list is
    taken, the list counts as done (no error, no list again), each odd object is passed
    on to the handler once under a key of its own (so the decoder records why it was
    skipped) and dropped when the server no longer lists it; items that are no object
    are counted and dropped; one log line per list. A
    watch event with metadata [] is passed on the same way; bookmarks whose
    resourceVersion is no usable string ("²", a list, a megabyte) are not resume points."""
    @bounded
    async def main() -> None:
        async with Harness(tmp_path) as h:
            h.server.put("a")
            h.server.put("b")
            h.server.junk = [*unkeyed(), *NOT_OBJECTS, odd_versions(), *unkeyed()[:2]]
            await h.synced()
            stats = h.reflector.stats
            named = {k: v for k, v in h.reflector.known.items() if not k[1].startswith("?")}
            assert named == {**h.server.keys(), ("default", "odd"): ""}, named
            assert stats.errors == stats.bad_lists == 0, stats
            assert stats.lists == 1, stats
            odd = {k for k in h.tally.objects if k[1].startswith("?")}
            assert len(odd) == len(unkeyed()), sorted(odd)
            # Counted, the items that are no object too (they are dropped: no kind, no
            # metadata, nothing for the decoder to say), repeats too.
            odd_items = len(unkeyed()) + len(NOT_OBJECTS) + 2
            assert stats.unkeyed == odd_items, stats
            (told,) = logged(caplog, "without a usable")
            assert "services.v1" in told and f"{odd_items} objects" in told, told
            assert "the first: metadata <list of 0>" in told, told

            # A watch: an event with metadata [], bookmarks with unusable versions, then
            # the server behaves again.
            reached = h.reflector.resource_version
            events = stats.events

            async def hostile(resp: web.StreamResponse, start: int) -> None:
                h.server.watches = None  # once
                await resp.write(line("ADDED", {"kind": "Service", "apiVersion": "v1",
                                                "metadata": [], "spec": {"x": 1}}))
                for rv in (["1"], "²", "9" * 300, "1 2", 12):
                    await resp.write(line("BOOKMARK", {"kind": "Service", "apiVersion": "v1",
                                                       "metadata": {"resourceVersion": rv}}))
                await resp.write(line("MODIFIED", {**service("b", 0), "metadata": {
                    "name": "b", "namespace": "default", "resourceVersion": "²"}}))
                await h.server._watch(resp, start, 1)

            h.server.watches = hostile
            await eventually(lambda: stats.events >= events + 2, what="the odd events")
            assert h.reflector.resource_version == reached
            assert len({k for k in h.tally.objects if k[1].startswith("?")}) == len(odd) + 1
            assert h.tally.objects[("default", "b")]["metadata"]["resourceVersion"] == "²"
            h.server.put("c")
            await eventually(lambda: ("default", "c") in h.tally.objects, what="c")
            assert stats.errors == 0 and stats.lists == 1, stats

            # A relist without them: each is deleted, as any vanished object is.
            async def gone(resp: web.StreamResponse, start: int) -> None:
                h.server.watches = None  # once: the watches after it behave
                await resp.write(GONE)

            h.server.junk = []
            h.server.watches = gone
            await eventually(lambda: stats.lists == 2, what="the relist")
            h.server.put("d")
            await h.converged()
            assert not [k for k in h.tally.objects if k[1].startswith("?")]
            assert "Traceback" not in caplog.text and not logged(caplog, "failed")

    run(main)
