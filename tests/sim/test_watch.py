"""Watch: ordering, resume, 410 on compacted history, bookmarks, timeouts, selectors."""

from __future__ import annotations

import time

from proxy.sim import SimServer
from tests.sim.client import EPS, SVC, Api, endpoint_slice, service, wait_for


def names(events: list[dict]) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return [(e["type"], e["object"]["metadata"]["name"]) for e in events]


def test_watch_from_rv_streams_every_later_change_in_order(sim: SimServer, api: Api) -> None:
    _, listed = api.get(SVC)
    start = listed["metadata"]["resourceVersion"]
    api.post(SVC, service("w1"))
    api.patch(f"{SVC}/w1", {"metadata": {"labels": {"x": "y"}}})
    api.post(SVC, service("w2"))
    api.delete(f"{SVC}/w1")
    api.post(EPS, endpoint_slice("other-type", "w2", ["198.18.1.1"]))  # not a service
    with api.watch(SVC, resourceVersion=start) as w:
        assert w.status == 200
        events = w.take(4)
        assert names(events) == [("ADDED", "w1"), ("MODIFIED", "w1"), ("ADDED", "w2"),
                                 ("DELETED", "w1")]
        rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
        assert rvs == sorted(rvs) and len(set(rvs)) == 4
        # Live events follow on the same stream.
        api.post(SVC, service("w3"))
        assert names(w.take(1)) == [("ADDED", "w3")]


def test_watch_without_rv_starts_with_synthetic_added_events(api: Api) -> None:
    api.post(SVC, service("s1"))
    api.post(SVC, service("s2"))
    for rv in (None, "0"):
        params = {"resourceVersion": rv} if rv else {}
        with api.watch(SVC, timeoutSeconds=1, **params) as w:
            assert sorted(names(w.take(2))) == [("ADDED", "s1"), ("ADDED", "s2")]
            api.patch(f"{SVC}/s1", {"metadata": {"labels": {"round": rv or "unset"}}})
            assert names(w.take(1)) == [("MODIFIED", "s1")]


def test_resume_after_a_cut_misses_nothing_and_repeats_nothing(sim: SimServer,
                                                               api: Api) -> None:
    _, listed = api.get(SVC)
    last = listed["metadata"]["resourceVersion"]
    seen: list[tuple[str, str]] = []
    for round_ in range(3):
        with api.watch(SVC, resourceVersion=last) as w:
            api.post(SVC, service(f"r{round_}"))
            event = w.take(1)[0]
            seen.append((event["type"], event["object"]["metadata"]["name"]))
            last = event["object"]["metadata"]["resourceVersion"]
            # Writes while the stream is being cut must come back on resume.
            api.post(SVC, service(f"r{round_}-late"))
            wait_for(lambda: sim.open_watches() == 1, what="watch registered")
            assert sim.cut_watches() == 1
            rest = w.rest()
            seen += names(rest)
            if rest:
                last = rest[-1]["object"]["metadata"]["resourceVersion"]
    with api.watch(SVC, resourceVersion=last, timeoutSeconds=1) as w:
        seen += names(w.rest())
    expected = [("ADDED", n) for r in range(3) for n in (f"r{r}", f"r{r}-late")]
    assert seen == expected


def test_compacted_rv_gets_an_error_event_with_410_expired(sim: SimServer, api: Api) -> None:
    _, listed = api.get(SVC)
    old = int(listed["metadata"]["resourceVersion"])
    api.post(SVC, service("c1"))
    api.post(SVC, service("c2"))
    compacted = sim.compact()
    with api.watch(SVC, resourceVersion=str(old)) as w:
        assert w.status == 200  # the real server answers 200 and an ERROR event
        events = w.rest()
    assert events == [{"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f"too old resource version: {old} ({compacted})", "reason": "Expired",
        "code": 410}}]
    # Resuming exactly at the compaction point is still fine.
    with api.watch(SVC, resourceVersion=str(compacted), timeoutSeconds=1) as w:
        api.post(SVC, service("c3"))
        assert names(w.take(1)) == [("ADDED", "c3")]


def test_history_limit_compacts_automatically() -> None:
    with SimServer(history_limit=3) as sim:
        api = Api(sim.url)
        _, listed = api.get(SVC)
        old = listed["metadata"]["resourceVersion"]
        for i in range(5):
            api.post(SVC, service(f"h{i}"))
        with api.watch(SVC, resourceVersion=old) as w:
            (event,) = w.rest()
        assert event["type"] == "ERROR" and event["object"]["code"] == 410


def test_bookmarks_only_when_asked_and_never_ahead_of_events(api: Api) -> None:
    _, listed = api.get(SVC)
    start = listed["metadata"]["resourceVersion"]
    with api.watch(SVC, resourceVersion=start, allowWatchBookmarks="true") as w:
        api.post(SVC, service("b1"))
        added = w.take(1)[0]
        marks = w.until(lambda e: e["type"] == "BOOKMARK")
        bookmark = marks[-1]
        assert bookmark["object"] == {"kind": "Service", "apiVersion": "v1", "metadata": {
            "resourceVersion": bookmark["object"]["metadata"]["resourceVersion"]}}
        assert int(bookmark["object"]["metadata"]["resourceVersion"]) >= int(
            added["object"]["metadata"]["resourceVersion"])
    with api.watch(SVC, resourceVersion=start, timeoutSeconds=1) as w:
        assert all(e["type"] != "BOOKMARK" for e in w.rest())


def test_timeout_seconds_ends_the_stream(api: Api) -> None:
    began = time.monotonic()
    with api.watch(SVC, timeoutSeconds=1) as w:
        assert w.rest() == []
    assert 0.9 <= time.monotonic() - began < 4


def test_selector_transitions_become_added_and_deleted(api: Api) -> None:
    _, listed = api.get(SVC)
    start = listed["metadata"]["resourceVersion"]
    api.post(SVC, service("t", labels={"app": "other"}))
    api.patch(f"{SVC}/t", {"metadata": {"labels": {"app": "web"}}})   # starts matching
    api.patch(f"{SVC}/t", {"metadata": {"labels": {"app": "web", "v": "2"}}})
    _, moved = api.patch(f"{SVC}/t", {"metadata": {"labels": {"app": "db"}}})  # stops
    api.delete(f"{SVC}/t")  # deleted while not matching: nothing
    with api.watch(SVC, resourceVersion=start, labelSelector="app=web",
                   timeoutSeconds=1) as w:
        events = w.rest()
    assert names(events) == [("ADDED", "t"), ("MODIFIED", "t"), ("DELETED", "t")]
    gone = events[-1]["object"]
    # The DELETED event shows the last matching content at the revision that moved it out.
    assert gone["metadata"]["labels"] == {"app": "web", "v": "2"}
    assert gone["metadata"]["resourceVersion"] == moved["metadata"]["resourceVersion"]


def test_field_selector_and_namespace_scope_on_watch(api: Api) -> None:
    api.post("/api/v1/namespaces", {"metadata": {"name": "other"}})
    _, listed = api.get(SVC)
    start = listed["metadata"]["resourceVersion"]
    api.post(SVC, service("f1"))
    api.post(SVC, service("f2"))
    api.post("/api/v1/namespaces/other/services", service("f1", "other"))
    with api.watch(SVC, resourceVersion=start, fieldSelector="metadata.name=f1",
                   timeoutSeconds=1) as w:
        assert [(e["object"]["metadata"]["namespace"], e["object"]["metadata"]["name"])
                for e in w.rest()] == [("default", "f1")]
    with api.watch("/api/v1/services", resourceVersion=start,
                   fieldSelector="metadata.namespace!=default", timeoutSeconds=1) as w:
        assert [e["object"]["metadata"]["namespace"] for e in w.rest()] == ["other"]


def test_send_initial_events_ends_with_an_annotated_bookmark(api: Api) -> None:
    api.post(SVC, service("i1"))
    with api.watch(SVC, sendInitialEvents="true", allowWatchBookmarks="true",
                   resourceVersionMatch="NotOlderThan", timeoutSeconds=1) as w:
        first, mark = w.take(2)
    assert first["type"] == "ADDED"
    assert mark["type"] == "BOOKMARK"
    assert mark["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_watch_from_a_future_rv_is_silent_until_revisions_pass_it(sim: SimServer,
                                                                 api: Api) -> None:
    # A client that watched a cluster which then lost its storage comes back with an RV
    # the new store has not reached. The watch cache neither errors nor replays: it sends
    # nothing, not even bookmarks, until revisions pass that RV.
    future = sim.resource_version + 3
    with api.watch(SVC, resourceVersion=str(future), allowWatchBookmarks="true",
                   timeoutSeconds=2) as w:
        wait_for(lambda: sim.open_watches() == 1, what="watch registered")
        for i in range(5):  # revisions future-2 .. future+2
            api.post(SVC, service(f"fut{i}"))
        events = w.until(lambda e: e["type"] == "BOOKMARK")
    assert names(events[:-1]) == [("ADDED", "fut3"), ("ADDED", "fut4")]
    assert int(events[-1]["object"]["metadata"]["resourceVersion"]) == future + 2


def test_expire_ends_open_watches_with_an_error_410(sim: SimServer, api: Api) -> None:
    _, listed = api.get(SVC)
    with api.watch(SVC, resourceVersion=listed["metadata"]["resourceVersion"]) as w:
        api.post(SVC, service("x1"))
        assert names(w.take(1)) == [("ADDED", "x1")]
        assert sim.expire_watches() == 1
        (error,) = w.rest()
    assert error["type"] == "ERROR"
    assert error["object"]["code"] == 410 and error["object"]["reason"] == "Expired"
    wait_for(lambda: sim.open_watches() == 0, what="watch cleaned up")
