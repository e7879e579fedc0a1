"""The watch layer (proxy.kube: Reflector, ClusterWatch over KubeApi) against the simulator
and the real v1.20.2 API server, with the same test code: list then watch, paging,
resume after a cut stream, bookmarks, 410 after compaction with a relist that loses
nothing, an expired continue token, selectors, and the EndpointSlice API fallback."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import pytest

from labs.realcp.clusters import (
    Cluster,
    Ep,
    GatedApi,
    endpoint_slice,
    service,
    services_path,
    slices_path,
)
from proxy.kube.client import ClientOptions, KubeApi
from proxy.kube.cluster_watch import ClusterWatch, endpoint_slice_resource
from proxy.kube.decode import decode_endpoint_slice
from proxy.kube.ingest import EndpointsSource
from proxy.kube.reflector import Reflector, ReflectorOptions, WatchEvent
from proxy.kube.resources import (
    ENDPOINT_SLICES_V1,
    ENDPOINT_SLICES_V1BETA1,
    NODES,
    SERVICES,
    Resource,
)
from proxy.model.types import EndpointSlice
from proxy.netns_lab.poll import eventually

pytestmark = [pytest.mark.realcp, pytest.mark.root]

Obj = dict[str, Any]
# Fast enough for tests, and long enough that a watch is not always restarting.
FAST = ReflectorOptions(page_size=2, min_watch_timeout=30.0, request_timeout=30.0,
                        backoff_initial=0.1, backoff_max=2.0)
SYNC = 30.0  # seconds to wait for a reflector to catch up (the API server restarts)


class Recorder:
    """Handler that keeps every event, and a mirror of the objects it implies."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str | None]] = []  # type, ns, name, rv
        self.mirror: dict[tuple[str, str], str] = {}  # (ns, name) -> rv

    def __call__(self, ev: WatchEvent) -> None:
        rv = (ev.obj or {}).get("metadata", {}).get("resourceVersion") if ev.obj else None
        self.events.append((ev.type, ev.namespace, ev.name, rv))
        if ev.type == "DELETED":
            self.mirror.pop((ev.namespace, ev.name), None)
        else:
            self.mirror[(ev.namespace, ev.name)] = str(rv)

    def since(self, index: int) -> list[tuple[str, str]]:
        return [(t, n) for t, _, n, _ in self.events[index:]]


async def _connect(cluster: Cluster) -> KubeApi:
    return await KubeApi.connect(ClientOptions(kubeconfig=str(cluster.kubeconfig)))


def _call(fn: Callable[..., Any], *args: Any, **kw: Any) -> Awaitable[Any]:
    """Blocking work (raw HTTP, etcdctl, an API server restart) off the reflector's loop."""
    return asyncio.to_thread(fn, *args, **kw)


def _server_state(cluster: Cluster, path: str, **params: str) -> dict[tuple[str, str], str]:
    status, body = cluster.raw.get(path, **params)
    assert status == 200, body
    return {(i["metadata"].get("namespace", ""), i["metadata"]["name"]):
            i["metadata"]["resourceVersion"] for i in body["items"]}


Scenario = Callable[[Reflector, GatedApi, Recorder], Awaitable[None]]


def run_reflector(cluster: Cluster, resource: Resource, options: ReflectorOptions,
                  scenario: Scenario) -> None:
    """Run a Reflector (through a GatedApi over KubeApi) while `scenario` drives it."""

    async def main() -> None:
        api = GatedApi(await _connect(cluster))
        rec = Recorder()
        reflector = Reflector(api, resource, rec, options)
        task = asyncio.create_task(reflector.run())
        try:
            await scenario(reflector, api, rec)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await api.close()

    asyncio.run(main())


def _watching(reflector: Reflector, count: int) -> bool:
    return reflector.stats.watches >= count


def _labelled(cluster: Cluster, hint: str) -> tuple[str, dict[str, str], str]:
    """A fresh namespace and a label unique to this test (reflectors list cluster-wide)."""
    ns = cluster.new_namespace(hint)
    return ns, {"test": ns}, f"test={ns}"


def _merge(cluster: Cluster, path: str, patch: Obj) -> Awaitable[Any]:
    return _call(cluster.raw.must, "PATCH", path, patch,
                 content_type="application/merge-patch+json")


def test_list_then_watch_pages_and_sees_every_change(cluster: Cluster) -> None:
    ns, labels, selector = _labelled(cluster, "list-watch")
    path = services_path(ns)
    for i in range(5):
        cluster.raw.must("POST", path, service(f"s{i}", ns, labels=labels))

    async def scenario(reflector: Reflector, api: GatedApi, rec: Recorder) -> None:
        await eventually(reflector.synced.is_set, SYNC, "the initial list")
        assert sorted(rec.since(0)) == [("ADDED", f"s{i}") for i in range(5)]
        lists = api.lists()
        # A consistent list (from etcd) is paged, every page at the first one's revision.
        assert [("continue" in q) for q in lists] == [False, True, True]
        assert [q.get("resourceVersion") for q in lists] == [None, None, None]
        mark = len(rec.events)
        await _call(cluster.raw.must, "POST", path, service("s5", ns, labels=labels))
        await _merge(cluster, f"{path}/s0", {"metadata": {"annotations": {"a": "1"}}})
        await _call(cluster.raw.must, "DELETE", f"{path}/s1")
        await eventually(lambda: len(rec.events) >= mark + 3, SYNC, "three watch events")
        assert rec.since(mark) == [("ADDED", "s5"), ("MODIFIED", "s0"), ("DELETED", "s1")]
        assert rec.mirror == _server_state(cluster, path)
        assert dict(reflector.known) == rec.mirror

    run_reflector(cluster, SERVICES, replace(FAST, label_selector=selector,
                                             consistent_first_list=True), scenario)


def test_the_first_list_comes_whole_from_the_watch_cache(cluster: Cluster) -> None:
    ns, labels, selector = _labelled(cluster, "list-cache")
    path = services_path(ns)
    for i in range(5):
        cluster.raw.must("POST", path, service(f"s{i}", ns, labels=labels))

    async def scenario(reflector: Reflector, api: GatedApi, rec: Recorder) -> None:
        await eventually(reflector.synced.is_set, SYNC, "the initial list")
        # resourceVersion=0 with a limit of 2: one answer with all five, no continue.
        (only,) = api.lists()
        assert only.get("resourceVersion") == "0" and only.get("limit") == "2", only
        assert sorted(rec.since(0)) == [("ADDED", f"s{i}") for i in range(5)]
        mark = len(rec.events)
        await _call(cluster.raw.must, "POST", path, service("s5", ns, labels=labels))
        await eventually(lambda: len(rec.events) > mark, SYNC, "a watch event")
        assert rec.since(mark) == [("ADDED", "s5")]
        assert rec.mirror == _server_state(cluster, path)

    run_reflector(cluster, SERVICES, replace(FAST, label_selector=selector), scenario)


def test_a_cut_stream_resumes_from_its_resource_version_without_a_relist(
        cluster: Cluster) -> None:
    ns, labels, selector = _labelled(cluster, "resume")
    path = services_path(ns)
    cluster.raw.must("POST", path, service("r0", ns, labels=labels))

    async def scenario(reflector: Reflector, api: GatedApi, rec: Recorder) -> None:
        await eventually(reflector.synced.is_set, SYNC, "the initial list")
        for round_ in range(1, 4):
            await eventually(functools.partial(_watching, reflector, round_), SYNC, "a watch")
            # The client is away while the stream is cut and the cluster changes.
            api.gate.clear()
            assert await _call(cluster.cut_streams) >= 1
            await _call(cluster.raw.must, "POST", path, service(f"r{round_}", ns,
                                                                labels=labels))
            await _merge(cluster, f"{path}/r{round_ - 1}",
                         {"metadata": {"annotations": {"round": str(round_)}}})
            await eventually(lambda: api.waiting > 0, SYNC, "the reflector to come back")
            api.gate.set()
        await eventually(lambda: len(rec.events) >= 7, SYNC, "every change")
        want = [("ADDED", "r0")] + [e for r in range(1, 4)
                                    for e in (("ADDED", f"r{r}"), ("MODIFIED", f"r{r - 1}"))]
        assert rec.since(0) == want  # each change exactly once, in order
        assert reflector.stats.lists == 1 and reflector.stats.relists == 0
        resumes = api.watches()[1:]
        assert len(resumes) >= 3 and all(q["resourceVersion"] for q in resumes)
        assert rec.mirror == _server_state(cluster, path)

    run_reflector(cluster, SERVICES, replace(FAST, label_selector=selector), scenario)


def test_bookmarks_advance_the_resource_version_past_unselected_changes(
        cluster: Cluster) -> None:
    """Changes the selector hides still move the reflector's resourceVersion forward via
    bookmarks, so a resume does not ask for history the server may have dropped."""
    ns, labels, selector = _labelled(cluster, "bookmarks")
    path = services_path(ns)
    cluster.raw.must("POST", path, service("seen", ns, labels=labels))

    async def scenario(reflector: Reflector, api: GatedApi, rec: Recorder) -> None:
        await eventually(reflector.synced.is_set, SYNC, "the initial list")
        listed = int(reflector.resource_version or 0)
        hidden = await _call(cluster.raw.must, "POST", path, service("hidden", ns))
        hidden_rv = int(hidden["metadata"]["resourceVersion"])
        await eventually(lambda: reflector.stats.bookmarks > 0, 20, "a bookmark")
        await eventually(lambda: int(reflector.resource_version or 0) >= hidden_rv, 20,
                         "a bookmark at or after the hidden change")
        assert int(reflector.resource_version or 0) > listed
        assert rec.since(0) == [("ADDED", "seen")]

    # timeoutSeconds of 3-5 s: the real server bookmarks 2 s before a watch's deadline.
    run_reflector(cluster, SERVICES, replace(FAST, label_selector=selector,
                                             min_watch_timeout=3.0), scenario)


def test_410_after_compaction_relists_and_emits_exactly_the_differences(
        cluster: Cluster) -> None:
    ns, labels, selector = _labelled(cluster, "relist")
    path = services_path(ns)
    for name in ("keep", "change", "drop"):
        cluster.raw.must("POST", path, service(name, ns, labels=labels))

    async def scenario(reflector: Reflector, api: GatedApi, rec: Recorder) -> None:
        await eventually(lambda: reflector.stats.watches >= 1, SYNC, "the first watch")
        mark = len(rec.events)
        api.gate.clear()
        await _call(cluster.cut_streams)
        await eventually(lambda: api.waiting > 0, SYNC, "the reflector to come back")
        # While it is away: one add, one change, one delete, then history is compacted.
        await _call(cluster.raw.must, "POST", path, service("new", ns, labels=labels))
        await _merge(cluster, f"{path}/change", {"metadata": {"annotations": {"v": "2"}}})
        await _call(cluster.raw.must, "DELETE", f"{path}/drop")
        await _call(cluster.compact)
        api.gate.set()
        await eventually(lambda: reflector.stats.relists >= 1, SYNC, "a relist after 410")
        await eventually(lambda: len(rec.events) >= mark + 3, SYNC, "the differences")
        assert sorted(rec.since(mark)) == [("ADDED", "new"), ("DELETED", "drop"),
                                           ("MODIFIED", "change")]
        assert rec.mirror == _server_state(cluster, path)
        assert reflector.stats.relists == 1
        # ...and the watch continues from the relist.
        await _call(cluster.raw.must, "POST", path, service("after", ns, labels=labels))
        await eventually(lambda: ("ADDED", "after") in rec.since(mark), SYNC, "a live event")

    run_reflector(cluster, SERVICES, replace(FAST, label_selector=selector), scenario)


def test_an_expired_continue_token_restarts_the_list(cluster: Cluster) -> None:
    ns, labels, selector = _labelled(cluster, "continue")
    path = services_path(ns)
    for i in range(6):
        cluster.raw.must("POST", path, service(f"c{i}", ns, labels=labels))
    compacted: list[bool] = []

    async def compact_before_second_page(_path: str, query: Mapping[str, str]) -> None:
        if "continue" in query and not compacted:
            compacted.append(True)
            await _call(cluster.raw.must, "POST", path, service("c6", ns, labels=labels))
            await _call(cluster.compact_storage)

    async def scenario(reflector: Reflector, api: GatedApi, rec: Recorder) -> None:
        api.before_get = compact_before_second_page
        await eventually(reflector.synced.is_set, SYNC, "a complete list")
        assert compacted
        # A continue that failed (410), then a whole new list; every object exactly once.
        lists = api.lists()
        assert [("continue" in q) for q in lists][:3] == [False, True, False]
        assert sorted(rec.since(0)) == [("ADDED", f"c{i}") for i in range(7)]
        assert rec.mirror == _server_state(cluster, path)

    run_reflector(cluster, SERVICES, replace(FAST, label_selector=selector,
                                             consistent_first_list=True), scenario)


def test_label_selector_changes_show_as_delete_and_add(cluster: Cluster) -> None:
    ns, labels, selector = _labelled(cluster, "selector")
    path = services_path(ns)
    cluster.raw.must("POST", path, service("in", ns, labels=labels))
    cluster.raw.must("POST", path, service("out", ns))

    async def scenario(reflector: Reflector, api: GatedApi, rec: Recorder) -> None:
        await eventually(lambda: reflector.stats.watches >= 1, SYNC, "a watch")
        assert rec.since(0) == [("ADDED", "in")]
        await _merge(cluster, f"{path}/in", {"metadata": {"labels": {"test": None}}})
        await _merge(cluster, f"{path}/out", {"metadata": {"labels": labels}})
        await eventually(lambda: len(rec.events) >= 3, SYNC, "two transitions")
        assert rec.since(1) == [("DELETED", "in"), ("ADDED", "out")]
        assert set(reflector.known) == {(ns, "out")}

    run_reflector(cluster, SERVICES, replace(FAST, label_selector=selector), scenario)


def test_a_field_selector_watches_one_node(cluster: Cluster) -> None:
    suffix = cluster.new_namespace("node")  # just a unique name
    mine, other = f"{suffix}-mine", f"{suffix}-other"
    for name in (mine, other):
        cluster.raw.must("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": "z1"}}})

    async def scenario(reflector: Reflector, api: GatedApi, rec: Recorder) -> None:
        await eventually(lambda: reflector.stats.watches >= 1, SYNC, "a watch")
        await _merge(cluster, f"/api/v1/nodes/{other}", {"metadata": {"labels": {"x": "1"}}})
        await _merge(cluster, f"/api/v1/nodes/{mine}",
                     {"metadata": {"labels": {"topology.kubernetes.io/zone": "z2"}}})
        await eventually(lambda: len(rec.events) >= 2, SYNC, "the node's change")
        assert rec.since(0) == [("ADDED", mine), ("MODIFIED", mine)]
        assert set(reflector.known) == {("", mine)}

    run_reflector(cluster, NODES, replace(FAST, field_selector=f"metadata.name={mine}"),
                  scenario)
    for name in (mine, other):
        cluster.raw.must("DELETE", f"/api/v1/nodes/{name}")


def test_cluster_watch_finds_the_slice_api_and_decodes_topology(cluster: Cluster) -> None:
    """v1.20 serves EndpointSlices only as discovery.k8s.io/v1beta1 (topology map); the
    simulator serves v1 (nodeName/zone). The watch layer must find the right one and
    decode node and zone from either."""
    ns = cluster.new_namespace("slices")
    node = f"{ns}-node"
    gv = cluster.slice_group_version()
    cluster.raw.must("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                               "metadata": {"name": node}})
    cluster.raw.must("POST", services_path(ns), service("web", ns))
    cluster.raw.must("POST", slices_path(gv, ns), endpoint_slice(gv, "web-a", ns, "web", [
        Ep("198.18.1.10", node=node, zone="zone-a"),
        Ep("198.18.1.11", node="elsewhere", zone="zone-b", ready=False)]))
    slices: dict[tuple[str, str], EndpointSlice] = {}
    nodes: set[str] = set()

    def handle(ev: WatchEvent) -> None:
        if ev.obj is None or ev.type == "DELETED":
            return
        if ev.resource.kind == "EndpointSlice":
            decoded, skips = decode_endpoint_slice(ev.obj)
            assert decoded is not None and not skips, skips
            slices[(ev.namespace, ev.name)] = decoded
        elif ev.resource.kind == "Node":
            nodes.add(ev.name)

    async def main() -> None:
        api = await _connect(cluster)
        try:
            resource = await endpoint_slice_resource(api)
            want = ENDPOINT_SLICES_V1BETA1 if gv.endswith("v1beta1") else ENDPOINT_SLICES_V1
            assert resource == want
            if cluster.name == "real":
                assert resource == ENDPOINT_SLICES_V1BETA1  # v1.20: no discovery.k8s.io/v1
            watch = ClusterWatch(api, node, EndpointsSource.ENDPOINT_SLICES, handle, FAST,
                                 slice_resource=resource)
            watch.start()
            try:
                await asyncio.wait_for(watch.wait_synced(), SYNC)
                await eventually(lambda: (ns, "web-a") in slices, SYNC, "the slice")
            finally:
                await watch.stop()
        finally:
            await api.close()

    asyncio.run(main())
    sl = slices[(ns, "web-a")]
    assert sl.service_name == "web"
    eps = {str(e.address): (e.node_name, e.zone, e.ready) for e in sl.endpoints}
    assert eps == {"198.18.1.10": (node, "zone-a", True),
                   "198.18.1.11": ("elsewhere", "zone-b", False)}
    assert nodes == {node}  # the field selector: only this node
    cluster.raw.must("DELETE", f"/api/v1/nodes/{node}")

