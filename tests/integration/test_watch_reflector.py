"""One reflector against the simulator through the real client library (KubeApi on
`kubernetes.aio`, configured from the kubeconfig the simulator writes), under uvloop:
list then watch, resume, bookmarks, 410 and relists that emit exactly the differences,
expired continue tokens, 500/429 with Retry-After, stalls, oversized events."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.kube.reflector import Reflector, ReflectorOptions
from proxy.kube.resources import SERVICES
from proxy.sim import SimServer
from tests.integration.watchkit import (
    FAST,
    LOOPS,
    GatedApi,
    Recorder,
    connect,
    eventually,
    in_thread,
    run,
    sim_keys,
)
from tests.sim.client import service


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(bookmark_interval=0.2) as server:
        yield server


class Harness:
    """A reflector for Services on a gated real client, its recorder, and its task."""

    def __init__(self, sim: SimServer, tmp: Path, options: ReflectorOptions = FAST) -> None:
        self.sim, self.tmp, self.options = sim, tmp, options
        self.rec = Recorder()

    async def __aenter__(self) -> Harness:
        self.api = GatedApi(await connect(self.sim, self.tmp))
        self.reflector = Reflector(self.api, SERVICES, self.rec, self.options)
        self.task = asyncio.create_task(self.reflector.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.api.close()

    async def synced(self) -> None:
        await asyncio.wait_for(self.reflector.synced.wait(), 15)

    async def converged(self, what: str = "reflector equals simulator") -> None:
        """The recorder and the reflector hold exactly the simulator's services."""
        def same() -> bool:
            want = sim_keys(self.sim, "services")
            return self.rec.keys("Service") == want and dict(self.reflector.known) == want

        await eventually(same, what=what, detail=lambda: (self.reflector.stats,
                                                          self.rec.keys("Service")))
        assert self.rec.violations == []

    async def watching(self, count: int) -> None:
        """Until the reflector has opened `count` watches and the server holds one."""
        await eventually(lambda: self.reflector.stats.watches >= count
                         and self.sim.open_watches() == 1, what=f"watch #{count} open")


@pytest.fixture
def uncached() -> Iterator[SimServer]:
    """A server started with --watch-cache=false: `resourceVersion=0` lists are paged."""
    with SimServer(bookmark_interval=0.2, watch_cache=False) as server:
        yield server


def test_the_first_list_comes_whole_from_the_watch_cache(sim: SimServer,
                                                          tmp_path: Path) -> None:
    for i in range(7):
        sim.create(service(f"s{i}"))

    async def main() -> None:
        async with Harness(sim, tmp_path) as h:
            await h.synced()
            assert sorted(h.rec.names()) == [("ADDED", f"s{i}") for i in range(7)]
            # resourceVersion=0: any revision will do, so the cache answers (no etcd
            # read); it ignores the limit and answers in one page.
            (only,) = h.api.lists()
            assert only.query["resourceVersion"] == "0" and only.query["limit"] == "3"
            assert h.reflector.resource_version == str(sim.resource_version)

    run(main)


@pytest.mark.parametrize("loop", LOOPS)
def test_list_in_pages_then_watch(uncached: SimServer, tmp_path: Path, loop: str) -> None:
    sim = uncached
    for i in range(7):
        sim.create(service(f"s{i}"))

    async def main() -> None:
        async with Harness(sim, tmp_path) as h:
            await h.synced()
            assert sorted(h.rec.names()) == [("ADDED", f"s{i}") for i in range(7)]
            lists = h.api.lists()
            assert [r.query.get("limit") for r in lists] == ["3", "3", "3"]  # 7 in 3 pages
            # Later pages carry the token alone (a resourceVersion beside it is refused).
            assert [r.query.get("resourceVersion") for r in lists] == ["0", None, None]
            assert h.reflector.resource_version == str(sim.resource_version)
            await h.watching(1)
            (watch,) = h.api.watches()
            assert watch.query["resourceVersion"] == h.reflector.resource_version
            assert watch.query["allowWatchBookmarks"] == "true"
            mark = len(h.rec.events)
            sim.create(service("new"))
            sim.update({**sim.get("v1", "Service", "s1"),
                        "metadata": {**sim.get("v1", "Service", "s1")["metadata"],
                                     "labels": {"x": "y"}}})
            sim.delete("v1", "Service", "s2")
            await h.converged()
            assert h.rec.names(mark) == [("ADDED", "new"), ("MODIFIED", "s1"),
                                         ("DELETED", "s2")]
            assert h.reflector.stats.lists == 1 and h.reflector.stats.relists == 0

    run(main, loop)


@pytest.mark.parametrize("abrupt", [False, True], ids=["clean", "abrupt"])
def test_resume_after_a_cut_from_the_last_rv(sim: SimServer, tmp_path: Path,
                                             abrupt: bool) -> None:
    async def main() -> None:
        async with Harness(sim, tmp_path) as h:
            await h.synced()
            await h.watching(1)
            sim.create(service("a"))
            await h.converged()
            last = h.reflector.resource_version
            # Hold the resumed watch so that changes happen while no stream is open.
            h.api.hold(lambda r: r.watch)
            assert sim.cut_watches(abrupt=abrupt) == 1
            await eventually(lambda: len(h.api.held) == 1, what="resume attempt")
            mark = len(h.rec.events)
            sim.create(service("b"))
            sim.delete("v1", "Service", "a")
            h.api.release()
            await h.converged()
            assert h.api.held[0].query["resourceVersion"] == last
            assert h.rec.names(mark) == [("ADDED", "b"), ("DELETED", "a")]
            assert h.reflector.stats.lists == 1  # resumed, never relisted

    run(main)


def test_bookmarks_advance_the_rv_so_resumes_survive_compaction(sim: SimServer,
                                                                tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(sim, tmp_path) as h:
            await h.synced()
            await h.watching(1)
            # Writes to other resources move the global revision past everything the
            # service watch has delivered; only bookmarks tell the reflector.
            for i in range(3):
                sim.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"n{i}"}})
            target = str(sim.resource_version)
            await eventually(lambda: h.reflector.resource_version == target,
                             what="a bookmark at the current revision")
            assert h.reflector.stats.bookmarks >= 1
            sim.compact()  # everything before `target` is gone
            sim.cut_watches()
            await h.watching(2)
            sim.create(service("after"))
            await h.converged()
            assert h.reflector.stats.expired == 0 and h.reflector.stats.lists == 1
            assert h.api.watches()[1].query["resourceVersion"] == target

    run(main)


def _churn_while_away(sim: SimServer) -> dict[str, str]:
    """Adds, updates and deletes, leaving some services untouched; the expected events."""
    sim.create(service("added"))
    changed = sim.get("v1", "Service", "s1")
    changed["metadata"]["labels"] = {"changed": "yes"}
    sim.update(changed)
    sim.delete("v1", "Service", "s2")
    # Deleted and created again under the same name: a different object.
    sim.delete("v1", "Service", "s3")
    sim.create(service("s3", labels={"again": "yes"}))
    # Created and deleted meanwhile: never seen, never emitted.
    sim.create(service("ghost"))
    sim.delete("v1", "Service", "ghost")
    return {"added": "ADDED", "s1": "MODIFIED", "s2": "DELETED", "s3": "MODIFIED"}


@pytest.mark.parametrize("where", ["open-stream", "new-request"])
def test_410_relists_and_emits_exactly_the_differences(sim: SimServer, tmp_path: Path,
                                                       where: str) -> None:
    for i in range(6):
        sim.create(service(f"s{i}"))

    async def main() -> None:
        async with Harness(sim, tmp_path) as h:
            await h.synced()
            await h.watching(1)
            reached = h.reflector.resource_version
            if where == "open-stream":
                # Stop reading; the server ends the open stream with ERROR 410; the
                # changes that follow are on no stream at all.
                h.api.reads.clear()
                assert sim.expire_watches() == 1
            else:
                h.api.hold(lambda r: r.watch)
                sim.cut_watches()
                await eventually(lambda: len(h.api.held) == 1, what="resume attempt")
            mark = len(h.rec.events)
            expected = _churn_while_away(sim)
            sim.compact()
            h.api.reads.set()
            h.api.release()
            await h.converged()
            stats = h.reflector.stats
            assert stats.expired == 1 and stats.relists == 1, stats
            assert sorted(h.rec.names(mark)) == sorted((t, n) for n, t in expected.items())
            # The relist asks for a state no older than the one it had reached, in one
            # page: the watch cache answers it (with a limit, etcd would).
            relist = h.api.lists()[-1].query
            assert relist["resourceVersion"] == reached and "limit" not in relist

    run(main)


def test_expired_continue_token_falls_back_to_one_unpaged_list(uncached: SimServer,
                                                                tmp_path: Path) -> None:
    sim = uncached
    for i in range(8):
        sim.create(service(f"s{i}"))

    async def main() -> None:
        async with Harness(sim, tmp_path) as h:
            h.api.hold(lambda r: "continue" in r.query)
            await eventually(lambda: len(h.api.held) == 1, what="second page requested")
            first_page = h.rec.names()
            assert len(first_page) == 3 and not h.reflector.synced.is_set()
            _churn_while_away(sim)
            sim.compact()
            h.api.release()
            await h.synced()
            await h.converged()
            assert h.reflector.stats.expired == 1 and h.reflector.stats.lists == 1
            continued, unpaged = h.api.lists()[-2:]
            assert "continue" in continued.query
            assert "limit" not in unpaged.query and "continue" not in unpaged.query
            # From storage: the snapshot the token named is gone, so is any revision
            # a cache could be asked to be no older than.
            assert "resourceVersion" not in unpaged.query

    run(main)


def test_a_relist_the_server_is_behind_for_is_read_from_storage(tmp_path: Path) -> None:
    # The server lost its storage; the resumed watch is answered 410; the relist from
    # our revision is answered 504 (too large resource version); the list after that is
    # a consistent read, below our revision, taken as the truth.
    with SimServer(bookmark_interval=0.2) as sim:
        for i in range(5):
            sim.create(service(f"s{i}"))

        async def main() -> None:
            async with Harness(sim, tmp_path) as h:
                await h.synced()
                await h.watching(1)
                reached = h.reflector.resource_version
                await in_thread(sim.restart, keep_state=False)
                # Resumed from our revision, in the new server's future: silence.
                await h.watching(2)
                sim.create(service("fresh"))
                assert sim.expire_watches() == 1
                await h.converged("the reflector forgot s0..s4 and found fresh")
                stats = h.reflector.stats
                assert stats.expired == 1 and "Too large resource version" in \
                    stats.last_error, stats
                assert stats.went_back == 1 and stats.relists == 1, stats
                from_cache, from_storage = [r.query for r in h.api.lists()[-2:]]
                assert from_cache["resourceVersion"] == reached and "limit" not in from_cache
                assert "resourceVersion" not in from_storage and "limit" in from_storage

        run(main)


@pytest.mark.parametrize(("code", "retry_after"), [(429, 1), (500, None)])
def test_errors_back_off_and_never_sooner_than_retry_after(sim: SimServer, tmp_path: Path,
                                                           code: int,
                                                           retry_after: int | None) -> None:
    async def main() -> None:
        async with Harness(sim, tmp_path) as h:
            await h.synced()
            await h.watching(1)
            sim.create(service("before"))  # a stream that delivered is no "short watch"
            await h.converged()
            sim.fail_next(3, code, retry_after)
            sim.cut_watches()
            await h.watching(2)
            sim.create(service("after"))
            await h.converged()
            attempts = h.api.watches()[1:]  # three failures, then the watch that worked
            assert len(attempts) == 4 and h.reflector.stats.errors == 3
            gaps = [b.at - a.at for a, b in itertools.pairwise(attempts)]
            if retry_after is not None:
                assert min(gaps) >= retry_after, gaps
            else:  # exponential: within [initial/2 * 2^n, initial * 2^n] each
                for n, gap in enumerate(gaps):
                    assert gap >= FAST.backoff_initial * 2**n / 2, gaps
            assert h.reflector.stats.last_error.startswith(f"_HttpError: HTTP {code}")

    run(main)


def test_errors_on_the_initial_list_are_retried(sim: SimServer, tmp_path: Path) -> None:
    sim.create(service("s"))
    sim.fail_next(2, 429, retry_after=1)

    async def main() -> None:
        async with Harness(sim, tmp_path) as h:
            await h.synced()
            first, second, ok = h.api.lists()[:3]
            assert second.at - first.at >= 1 and ok.at - second.at >= 1
            await h.converged()

    run(main)


def test_a_quiet_resource_costs_a_probe_not_a_relist(tmp_path: Path) -> None:
    # No bookmarks from this server: every stream of a quiet resource goes silent.
    with SimServer(bookmark_interval=3600) as sim:
        sim.create(service("s"))
        options = replace(FAST, stall_timeout=0.5)

        async def main() -> None:
            async with Harness(sim, tmp_path, options) as h:
                await h.synced()
                await eventually(lambda: h.reflector.stats.stalls == 1, what="a stall")
                # The first stall reopens the watch from the same revision.
                await eventually(lambda: len(h.api.watches()) == 2, what="watch reopened")
                first, second = h.api.watches()
                assert first.query["resourceVersion"] == second.query["resourceVersion"]
                # A second silent stream: one small list asks for the server's revision;
                # it is not below ours, so the watch resumes where it was, no relist.
                await eventually(lambda: len(h.api.watches()) == 3, what="watch resumed")
                stats = h.reflector.stats
                assert stats.stalls == 2 and stats.probes == 1, stats
                assert stats.lists == 1 and stats.relists == 0, stats
                probe = h.api.lists()[-1]
                assert probe.query.get("limit") == "1" and "continue" not in probe.query
                assert h.api.watches()[-1].query["resourceVersion"] == \
                    first.query["resourceVersion"]
                mark = len(h.rec.events)
                sim.create(service("t"))
                await h.converged()
                assert h.rec.names(mark) == [("ADDED", "t")]

        run(main)


def test_a_server_that_lost_its_storage_is_listed_again(tmp_path: Path) -> None:
    # Silent streams, then a probe showing the server's revision below ours: relist.
    with SimServer(bookmark_interval=3600) as sim:
        for i in range(5):
            sim.create(service(f"s{i}"))
        options = replace(FAST, stall_timeout=0.5)

        async def main() -> None:
            async with Harness(sim, tmp_path, options) as h:
                await h.synced()
                await in_thread(sim.restart, keep_state=False)
                sim.create(service("fresh"))  # revision 1 or so: far below ours
                await h.converged("the reflector forgot s0..s4 and found fresh")
                stats = h.reflector.stats
                assert stats.probes >= 1 and stats.relists == 1, stats

        run(main)


def test_an_oversized_event_is_skipped_and_the_stream_goes_on(sim: SimServer,
                                                              tmp_path: Path) -> None:
    options = replace(FAST, max_line_bytes=32 * 1024)

    async def main() -> None:
        async with Harness(sim, tmp_path, options) as h:
            await h.synced()
            await h.watching(1)
            huge = service("huge")
            huge["metadata"]["annotations"] = {"blob": "x" * 100_000}
            sim.create(huge)
            sim.create(service("small"))
            await eventually(lambda: ("ADDED", "small") in h.rec.names(), what="small")
            assert h.reflector.stats.oversized == 1
            assert ("default", "huge") not in h.reflector.known
            assert [n for _, n in h.rec.names()] == ["small"]
            assert h.reflector.stats.errors == 0 and len(h.api.watches()) == 1

    run(main)


def test_a_short_watch_backs_off_instead_of_hammering(sim: SimServer, tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(sim, tmp_path) as h:
            await h.synced()
            for n in range(1, 4):  # cut every stream as soon as it opens
                await h.watching(n)
                sim.cut_watches()
            await h.watching(4)
            stats = h.reflector.stats
            assert stats.short_watches == 3 and stats.errors == 3
            opened = [r.at for r in h.api.watches()]
            gaps = [b - a for a, b in itertools.pairwise(opened)]
            assert all(g >= FAST.backoff_initial * 2**n / 2 for n, g in enumerate(gaps)), gaps

    run(main)
