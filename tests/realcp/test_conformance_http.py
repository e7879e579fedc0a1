"""What a client sees on the wire, the same test code against the simulator and the real
v1.20.2 API server: status codes, Status bodies, list and watch-event shapes, 410 after
compaction, bookmarks, selectors and paging. Where the two differed, the simulator was
wrong and was fixed (the commits that touch proxy/sim/ say where)."""

from __future__ import annotations

import time
from ipaddress import IPv4Address, IPv4Network
from typing import Any

import pytest

from labs.realcp.clusters import Cluster, service, services_path

pytestmark = [pytest.mark.realcp, pytest.mark.root]

SERVICE_CIDR = IPv4Network("198.18.128.0/17")
Obj = dict[str, Any]


def _names(items: list[Obj]) -> list[str]:
    return [i["metadata"]["name"] for i in items]


def _events(events: list[Obj]) -> list[tuple[str, str]]:
    return [(e["type"], e["object"]["metadata"]["name"]) for e in events]


def _rv(obj: Obj) -> int:
    return int(obj["metadata"]["resourceVersion"])


def _create(cluster: Cluster, ns: str, name: str, **kw: Any) -> Obj:
    obj: Obj = cluster.raw.must("POST", services_path(ns), service(name, ns, **kw))
    return obj


def test_list_has_a_typed_shape_and_a_resource_version(cluster: Cluster) -> None:
    ns = cluster.new_namespace("list-shape")
    _create(cluster, ns, "b")
    _create(cluster, ns, "a")
    status, body = cluster.raw.get(services_path(ns))
    assert status == 200
    assert body["kind"] == "ServiceList" and body["apiVersion"] == "v1"
    assert body["metadata"]["resourceVersion"].isdigit()
    assert "continue" not in body["metadata"]
    assert _names(body["items"]) == ["a", "b"]
    for item in body["items"]:
        # Items of a typed list carry neither kind nor apiVersion on the wire.
        assert "kind" not in item and "apiVersion" not in item
        meta = item["metadata"]
        assert meta["uid"] and meta["creationTimestamp"] and meta["resourceVersion"].isdigit()
        assert IPv4Address(item["spec"]["clusterIP"]) in SERVICE_CIDR


def test_watch_from_a_list_streams_changes_in_order_with_full_objects(
        cluster: Cluster) -> None:
    ns = cluster.new_namespace("watch-order")
    path = services_path(ns)
    _, listed = cluster.raw.get(path)
    start = listed["metadata"]["resourceVersion"]
    _create(cluster, ns, "w1")
    cluster.raw.must("PATCH", f"{path}/w1", {"metadata": {"labels": {"x": "y"}}},
                     content_type="application/merge-patch+json")
    _create(cluster, ns, "w2")
    cluster.raw.must("DELETE", f"{path}/w1")
    with cluster.raw.watch(path, resourceVersion=start) as w:
        assert w.status == 200
        events = w.take(4)
        assert _events(events) == [("ADDED", "w1"), ("MODIFIED", "w1"), ("ADDED", "w2"),
                                   ("DELETED", "w1")]
        rvs = [_rv(e["object"]) for e in events]
        assert rvs == sorted(rvs) and len(set(rvs)) == 4 and rvs[0] > int(start)
        for e in events:
            assert e["object"]["kind"] == "Service" and e["object"]["apiVersion"] == "v1"
            assert set(e) == {"type", "object"}
        # The DELETED event carries the object's last state, stamped with the deletion rv.
        assert events[3]["object"]["metadata"]["labels"] == {"x": "y"}
        # Live changes follow on the same stream.
        _create(cluster, ns, "w3")
        assert _events(w.take(1)) == [("ADDED", "w3")]


def test_watch_without_rv_starts_with_the_current_state_as_added(cluster: Cluster) -> None:
    ns = cluster.new_namespace("watch-initial")
    path = services_path(ns)
    _create(cluster, ns, "s1")
    _create(cluster, ns, "s2")
    for rv in (None, "0"):
        params: dict[str, Any] = {"timeoutSeconds": 5, **({"resourceVersion": rv} if rv else {})}
        with cluster.raw.watch(path, **params) as w:
            assert sorted(_events(w.take(2))) == [("ADDED", "s1"), ("ADDED", "s2")]
            cluster.raw.must("PATCH", f"{path}/s1", {"metadata": {"labels": {"p": "1"}}},
                             content_type="application/merge-patch+json")
            got = w.take(1)
            assert _events(got) == [("MODIFIED", "s1")]
            cluster.raw.must("PATCH", f"{path}/s1", {"metadata": {"labels": {"p": None}}},
                             content_type="application/merge-patch+json")


def test_watch_from_a_compacted_rv_gets_one_410_expired_error_event(cluster: Cluster) -> None:
    ns = cluster.new_namespace("watch-410")
    path = services_path(ns)
    _, listed = cluster.raw.get(path)
    old = listed["metadata"]["resourceVersion"]
    _create(cluster, ns, "c1")
    _create(cluster, ns, "c2")
    cluster.compact()
    # The error event comes at once. kube-apiserver v1.20.2 then sometimes keeps the
    # stream open until the watch's own timeout (seen: the event after 0.05 s, the end of
    # the stream after timeoutSeconds), so a short timeoutSeconds ends it either way: the
    # events it carried until then are judged, all of them.
    with cluster.raw.watch(path, read_timeout=20.0, resourceVersion=old,
                           timeoutSeconds=3) as w:
        assert w.status == 200  # not an HTTP 410: the error arrives as an event
        events = w.rest()
    assert len(events) == 1, events
    assert events[0]["type"] == "ERROR"
    status = events[0]["object"]
    assert set(status) == {"kind", "apiVersion", "metadata", "status", "message", "reason",
                           "code"}
    assert (status["kind"], status["apiVersion"], status["metadata"], status["status"],
            status["reason"], status["code"]) == ("Status", "v1", {}, "Failure", "Expired", 410)
    assert status["message"].startswith(f"too old resource version: {old} (")


def test_a_bookmark_before_the_timeout_carries_hidden_progress(cluster: Cluster) -> None:
    """A change the selector hides still moves a client forward: the real server (watch
    cache) sends a BOOKMARK 2 s before a watch's deadline (and every minute) carrying the
    last resourceVersion of this resource type it processed, if that is newer than what
    the watcher has seen. client-go resumes from it without a relist."""
    ns = cluster.new_namespace("bookmark")
    path = services_path(ns)
    _, listed = cluster.raw.get(path)
    start = int(listed["metadata"]["resourceVersion"])
    began = time.monotonic()
    with cluster.raw.watch(path, resourceVersion=str(start), allowWatchBookmarks="true",
                           labelSelector="app=shown", timeoutSeconds=5) as w:
        hidden = _create(cluster, ns, "hidden", labels={"app": "hidden"})
        events = w.rest()
    took = time.monotonic() - began
    assert took < 15, f"a 5 s watch lasted {took:.1f}s"
    assert events and all(e["type"] == "BOOKMARK" for e in events), events
    obj = events[-1]["object"]
    assert obj["kind"] == "Service" and obj["apiVersion"] == "v1"
    assert _rv(obj) >= _rv(hidden) > start


def test_no_bookmarks_unless_asked_for(cluster: Cluster) -> None:
    ns = cluster.new_namespace("no-bookmark")
    path = services_path(ns)
    _, listed = cluster.raw.get(path)
    with cluster.raw.watch(path, resourceVersion=listed["metadata"]["resourceVersion"],
                           timeoutSeconds=3) as w:
        assert w.rest() == []


def test_label_selectors_on_list_and_watch(cluster: Cluster) -> None:
    ns = cluster.new_namespace("labels")
    path = services_path(ns)
    _create(cluster, ns, "a", labels={"tier": "web"})
    _create(cluster, ns, "b", labels={"tier": "db"})
    _create(cluster, ns, "c")
    cases = {"tier=web": ["a"], "tier!=web": ["b", "c"], "tier in (web,db)": ["a", "b"],
             "tier notin (web)": ["b", "c"], "tier": ["a", "b"], "!tier": ["c"],
             "tier=web,tier=db": []}
    for selector, want in cases.items():
        status, body = cluster.raw.get(path, labelSelector=selector)
        assert status == 200, body
        assert _names(body["items"]) == want, selector
    status, body = cluster.raw.get(path, labelSelector="tier in web")
    assert status == 400 and body["reason"] == "BadRequest", body
    start = cluster.raw.get(path)[1]["metadata"]["resourceVersion"]
    with cluster.raw.watch(path, resourceVersion=start, labelSelector="tier=web") as w:
        # a leaves the selection (DELETED), b enters it (ADDED), c never matters.
        cluster.raw.must("PATCH", f"{path}/a", {"metadata": {"labels": {"tier": "db"}}},
                         content_type="application/merge-patch+json")
        cluster.raw.must("PATCH", f"{path}/c", {"metadata": {"labels": {"x": "1"}}},
                         content_type="application/merge-patch+json")
        cluster.raw.must("PATCH", f"{path}/b", {"metadata": {"labels": {"tier": "web"}}},
                         content_type="application/merge-patch+json")
        events = w.take(2)
    assert _events(events) == [("DELETED", "a"), ("ADDED", "b")]
    # The object that left is sent as it was when it last matched (old labels), stamped
    # with the revision of the change that made it leave.
    gone = events[0]["object"]
    assert gone["metadata"]["labels"] == {"tier": "web"}
    assert _rv(gone) < _rv(events[1]["object"])


def test_field_selectors_on_list_and_watch(cluster: Cluster) -> None:
    ns = cluster.new_namespace("fields")
    other = cluster.new_namespace("fields-other")
    _create(cluster, ns, "a")
    _create(cluster, ns, "b")
    _create(cluster, other, "a")
    status, body = cluster.raw.get(services_path(ns), fieldSelector="metadata.name=a")
    assert status == 200 and _names(body["items"]) == ["a"]
    status, body = cluster.raw.get(services_path(ns), fieldSelector="metadata.name!=a")
    assert _names(body["items"]) == ["b"]
    status, body = cluster.raw.get(services_path(), fieldSelector=f"metadata.namespace={other}")
    assert status == 200 and [(i["metadata"]["namespace"], i["metadata"]["name"])
                              for i in body["items"]] == [(other, "a")]
    start = cluster.raw.get(services_path(ns))[1]["metadata"]["resourceVersion"]
    with cluster.raw.watch(services_path(ns), resourceVersion=start,
                           fieldSelector="metadata.name=b") as w:
        cluster.raw.must("DELETE", f"{services_path(ns)}/a")
        cluster.raw.must("DELETE", f"{services_path(ns)}/b")
        assert _events(w.take(1)) == [("DELETED", "b")]


def test_unknown_field_selectors_are_rejected_in_the_servers_words(
        cluster: Cluster) -> None:
    generic = ('"spec.foo" is not a known field selector: only "metadata.name", '
               '"metadata.namespace"')
    # Kinds without field-label conversions get the generic message; Node and Namespace
    # (which have their own, e.g. spec.unschedulable, status.phase) the short one.
    want = {"/api/v1/services": generic, "/api/v1/endpoints": generic,
            "/api/v1/nodes": "field label not supported: spec.foo",
            "/api/v1/namespaces": "field label not supported: spec.foo"}
    for path, message in want.items():
        status, body = cluster.raw.get(path, fieldSelector="spec.foo=x")
        assert (status, body["reason"], body["message"]) == (400, "BadRequest", message), path


def test_a_too_large_resource_version_is_a_504_with_retry_after(
        cluster: Cluster) -> None:
    ns = cluster.new_namespace("too-large")
    path = services_path(ns)
    current = int(cluster.raw.get(path)[1]["metadata"]["resourceVersion"])
    future = current + 100_000
    # The real server waits up to 3 s for its cache to catch up before answering.
    status, body, headers = cluster.raw.request("GET", path,
                                                params={"resourceVersion": str(future)})
    assert status == 504 and headers.get("Retry-After") == "1", (status, headers)
    assert (body["reason"], body["details"]) == ("Timeout", {
        "causes": [{"reason": "ResourceVersionTooLarge",
                    "message": "Too large resource version"}], "retryAfterSeconds": 1})
    assert body["message"].startswith(f"Timeout: Too large resource version: {future}, "
                                      "current: ")


def test_paging_is_a_consistent_snapshot(cluster: Cluster) -> None:
    ns = cluster.new_namespace("paging")
    path = services_path(ns)
    for name in ("p1", "p2", "p3", "p4", "p5"):
        _create(cluster, ns, name)
    pages: list[Obj] = []
    token = None
    while True:
        params = {"limit": "2", **({"continue": token} if token else {})}
        status, body = cluster.raw.get(path, **params)
        assert status == 200, body
        pages.append(body)
        if len(pages) == 1:
            _create(cluster, ns, "p0")  # after the snapshot: not in this list
            cluster.raw.must("DELETE", f"{path}/p5")  # nor is its deletion
        token = body["metadata"].get("continue")
        if not token:
            break
    assert [_names(p["items"]) for p in pages] == [["p1", "p2"], ["p3", "p4"], ["p5"]]
    assert [p["metadata"].get("remainingItemCount") for p in pages] == [3, 1, None]
    assert len({p["metadata"]["resourceVersion"] for p in pages}) == 1


def test_a_list_at_resource_version_0_comes_whole_from_the_watch_cache(
        cluster: Cluster) -> None:
    """What the reflector's first list relies on: `resourceVersion=0` is answered from the
    watch cache (no read from etcd), which cannot continue a list, so `limit` is ignored:
    every item in one answer, no continue token. (Its order is the cache's, not sorted.)"""
    ns = cluster.new_namespace("list-rv0")
    path = services_path(ns)
    names = {f"c{i}" for i in range(5)}
    for name in names:
        _create(cluster, ns, name)
    status, body = cluster.raw.get(path, limit="2", resourceVersion="0")
    assert status == 200, body
    assert set(_names(body["items"])) == names and len(body["items"]) == 5
    assert "continue" not in body["metadata"] and "remainingItemCount" not in body["metadata"]
    # Not older than a revision we name, without a limit: the cache again, whole.
    status, again = cluster.raw.get(path, resourceVersion=body["metadata"]["resourceVersion"])
    assert status == 200 and set(_names(again["items"])) == names
    assert _rv(again) >= _rv(body)


def test_an_expired_continue_token_is_410_with_a_fresh_token(cluster: Cluster) -> None:
    ns = cluster.new_namespace("continue-410")
    path = services_path(ns)
    for name in ("e1", "e2", "e3", "e4"):
        _create(cluster, ns, name)
    _, first = cluster.raw.get(path, limit="2")
    token = first["metadata"]["continue"]
    _create(cluster, ns, "e5")
    cluster.compact_storage()
    status, body = cluster.raw.get(path, limit="2", **{"continue": token})
    assert status == 410, body
    assert (body["kind"], body["status"], body["reason"], body["code"]) == (
        "Status", "Failure", "Expired", 410)
    assert body["message"].startswith("The provided continue parameter is too old")
    fresh = body["metadata"]["continue"]
    # The fresh token continues after the same key, at the latest revision (so e5 shows).
    status, rest = cluster.raw.get(path, limit="10", **{"continue": fresh})
    assert status == 200, rest
    assert _names(rest["items"]) == ["e3", "e4", "e5"]


def test_errors_are_status_objects(cluster: Cluster) -> None:
    ns = cluster.new_namespace("status")
    path = services_path(ns)
    status, body = cluster.raw.get(f"{path}/nope")
    assert status == 404
    assert body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": 'services "nope" not found', "reason": "NotFound",
                    "details": {"name": "nope", "kind": "services"}, "code": 404}
    created = _create(cluster, ns, "dup")
    status, body = cluster.raw.post(path, service("dup", ns))
    assert status == 409
    assert body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": 'services "dup" already exists', "reason": "AlreadyExists",
                    "details": {"name": "dup", "kind": "services"}, "code": 409}
    stale = dict(created)
    stale["metadata"] = {**created["metadata"], "labels": {"a": "b"}}
    cluster.raw.must("PATCH", f"{path}/dup", {"metadata": {"labels": {"c": "d"}}},
                     content_type="application/merge-patch+json")
    status, body = cluster.raw.put(f"{path}/dup", stale)
    assert status == 409
    assert body == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'Operation cannot be fulfilled on services "dup": the object has been '
                   "modified; please apply your changes to the latest version and try again",
        "reason": "Conflict", "details": {"name": "dup", "kind": "services"}, "code": 409}
