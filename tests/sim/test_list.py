"""Lists: selectors, paging with a consistent snapshot, expired continue tokens, and the
resourceVersion rules."""

from __future__ import annotations

import pytest

from proxy.sim import SimServer
from tests.sim.client import SVC, Api, service

LABELS = {
    "a": {"app": "web", "tier": "front", "n": "3"},
    "b": {"app": "web", "tier": "back", "n": "10"},
    "c": {"app": "db"},
    "d": {},
}


@pytest.fixture
def labelled(api: Api) -> Api:
    for name, labels in LABELS.items():
        api.post(SVC, service(name, labels=labels))
    return api


@pytest.mark.parametrize(("selector", "expected"), [
    ("app=web", "ab"),
    ("app==web", "ab"),
    ("app!=web", "cd"),  # != also matches objects without the key
    ("app in (web,db)", "abc"),
    ("app notin (web)", "cd"),
    ("tier", "ab"),
    ("!tier", "cd"),
    ("app=web,tier=back", "b"),
    ("app=web,!tier", ""),
    ("n>5", "b"),
    ("n<5", "a"),
    ("", "abcd"),
])
def test_label_selectors(labelled: Api, selector: str, expected: str) -> None:
    status, body = labelled.get(SVC, labelSelector=selector)
    assert status == 200
    assert "".join(o["metadata"]["name"] for o in body["items"]) == expected


@pytest.mark.parametrize(("selector", "expected"), [
    ("metadata.name=a", "a"),
    ("metadata.name==b", "b"),
    ("metadata.name!=a", "bcd"),
    ("metadata.name!=a,metadata.name!=b", "cd"),
    ("metadata.namespace=default", "abcd"),
    ("metadata.namespace=other", ""),
])
def test_field_selectors(labelled: Api, selector: str, expected: str) -> None:
    status, body = labelled.get(SVC, fieldSelector=selector)
    assert status == 200
    assert "".join(o["metadata"]["name"] for o in body["items"]) == expected


def test_node_and_namespace_field_labels_of_their_own(api: Api) -> None:
    # As upstream's field-label conversions: Node knows spec.unschedulable, Namespace
    # status.phase; other kinds only metadata.name and metadata.namespace.
    for name, unschedulable in (("n1", True), ("n2", False)):
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                "spec": {"unschedulable": unschedulable}}
        assert api.post("/api/v1/nodes", node)[0] == 201
    status, body = api.get("/api/v1/nodes", fieldSelector="spec.unschedulable=false")
    assert status == 200 and [o["metadata"]["name"] for o in body["items"]] == ["n2"]
    status, body = api.get("/api/v1/namespaces", fieldSelector="status.phase=Active")
    assert status == 200 and "default" in {o["metadata"]["name"] for o in body["items"]}
    status, body = api.get("/api/v1/nodes", fieldSelector="spec.foo=x")
    assert (status, body["message"]) == (400, "field label not supported: spec.foo")
    status, body = api.get(SVC, fieldSelector="spec.foo=x")
    assert (status, body["message"]) == (400, '"spec.foo" is not a known field selector: '
                                              'only "metadata.name", "metadata.namespace"')


@pytest.mark.parametrize(("param", "value"), [
    ("labelSelector", "app in (web"),
    ("labelSelector", "a=b=c"),
    ("fieldSelector", "spec.type=ClusterIP"),
    ("fieldSelector", "metadata.name"),
])
def test_bad_selectors_are_400(api: Api, param: str, value: str) -> None:
    status, body = api.get(SVC, **{param: value})
    assert status == 400 and body["reason"] == "BadRequest"


def test_paging_is_a_consistent_snapshot(api: Api) -> None:
    for i in range(7):
        api.post(SVC, service(f"p{i}"))
    status, page = api.get(SVC, limit=3)
    first_rv = page["metadata"]["resourceVersion"]
    assert [o["metadata"]["name"] for o in page["items"]] == ["p0", "p1", "p2"]
    assert page["metadata"]["remainingItemCount"] == 4
    # Changes after the first page must not show up in later pages.
    api.delete(f"{SVC}/p4")
    api.post(SVC, service("p9"))
    api.patch(f"{SVC}/p5", {"metadata": {"labels": {"late": "yes"}}})
    names = [o["metadata"]["name"] for o in page["items"]]
    while token := page["metadata"].get("continue"):
        status, page = api.get(SVC, limit=3, **{"continue": token})
        assert status == 200 and page["metadata"]["resourceVersion"] == first_rv
        names += [o["metadata"]["name"] for o in page["items"]]
        assert all("late" not in (o["metadata"].get("labels") or {}) for o in page["items"])
    assert names == [f"p{i}" for i in range(7)]
    assert "remainingItemCount" not in page["metadata"]


def test_paging_with_a_selector_fills_pages_with_matches(labelled: Api) -> None:
    _, page = labelled.get(SVC, limit=1, labelSelector="app=web")
    assert [o["metadata"]["name"] for o in page["items"]] == ["a"]
    assert "remainingItemCount" not in page["metadata"]  # upstream omits it with selectors
    _, page = labelled.get(SVC, limit=1, labelSelector="app=web",
                           **{"continue": page["metadata"]["continue"]})
    assert [o["metadata"]["name"] for o in page["items"]] == ["b"]


def test_expired_continue_is_410_with_an_inconsistent_token(sim: SimServer, api: Api) -> None:
    for i in range(4):
        api.post(SVC, service(f"e{i}"))
    _, page = api.get(SVC, limit=2)
    api.post(SVC, service("e9"))
    sim.compact()
    status, body = api.get(SVC, limit=2, **{"continue": page["metadata"]["continue"]})
    assert status == 410 and body["reason"] == "Expired" and body["code"] == 410
    assert body["message"].startswith("The provided continue parameter is too old to display "
                                      "a consistent list result.")
    token = body["metadata"]["continue"]
    # The token handed back continues at the latest state (an inconsistent list).
    status, rest = api.get(SVC, limit=10, **{"continue": token})
    assert status == 200
    assert [o["metadata"]["name"] for o in rest["items"]] == ["e2", "e3", "e9"]


def test_invalid_continue_token_and_rv_with_continue_are_400(api: Api) -> None:
    assert api.get(SVC, **{"continue": "not-a-token"})[0] == 400
    api.post(SVC, service("x1"))
    api.post(SVC, service("x2"))
    _, page = api.get(SVC, limit=1)
    status, _ = api.get(SVC, resourceVersion="5", **{"continue": page["metadata"]["continue"]})
    assert status == 400


def test_list_resource_version_semantics(sim: SimServer, api: Api) -> None:
    _, before = api.post(SVC, service("v1"))
    api.post(SVC, service("v2"))
    old = before["metadata"]["resourceVersion"]
    # Exact: the state as of that revision.
    status, body = api.get(SVC, resourceVersion=old, resourceVersionMatch="Exact")
    assert status == 200 and body["metadata"]["resourceVersion"] == old
    assert [o["metadata"]["name"] for o in body["items"]] == ["v1"]
    # NotOlderThan / unset: at least that fresh; the simulator is never behind.
    status, body = api.get(SVC, resourceVersion=old)
    assert [o["metadata"]["name"] for o in body["items"]] == ["v1", "v2"]
    # From the future: 504 Timeout "Too large resource version".
    status, body = api.get(SVC, resourceVersion="999999")
    assert status == 504 and body["details"]["causes"][0]["reason"] == "ResourceVersionTooLarge"
    sim.compact()
    status, body = api.get(SVC, resourceVersion=old, resourceVersionMatch="Exact")
    assert status == 410
    assert body["message"] == "The resourceVersion for the provided list is too old."


def test_namespaced_and_cluster_wide_lists(api: Api) -> None:
    api.post("/api/v1/namespaces", {"metadata": {"name": "other"}})
    api.post(SVC, service("here"))
    api.post("/api/v1/namespaces/other/services", service("there", "other"))
    _, everywhere = api.get("/api/v1/services")
    assert [(o["metadata"]["namespace"], o["metadata"]["name"]) for o in everywhere["items"]] \
        == [("default", "here"), ("other", "there")]
    _, local = api.get("/api/v1/namespaces/other/services")
    assert [o["metadata"]["name"] for o in local["items"]] == ["there"]
    _, nodes = api.get("/api/v1/nodes")
    assert nodes["kind"] == "NodeList" and nodes["items"] == []
