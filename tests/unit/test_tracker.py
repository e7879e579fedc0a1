"""Change tracking: only affected service ports get dirty; incremental equals from scratch."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.kube.ingest import apply_object, delete_object
from proxy.model.tracker import ClusterModel
from proxy.model.types import Family, ServicePortKey
from tests.unit.builders import NODE, addrs, ep, eps_slice, model_of, node, service

TWO_PORTS = ({"name": "http", "port": 80}, {"name": "metrics", "port": 9090})
HTTP = ServicePortKey("ns", "svc", "http", Family.V4)
METRICS = ServicePortKey("ns", "svc", "metrics", Family.V4)


def test_slice_change_marks_only_the_ports_it_lists() -> None:
    model = model_of(node(), service(ports=TWO_PORTS),
                     eps_slice("s1", [ep("198.18.1.1")]),
                     eps_slice("m1", [ep("198.18.1.1")],
                               ports=({"name": "metrics", "port": 9090},)))
    model.resolve()
    apply_object(model, eps_slice("s1", [ep("198.18.1.1"), ep("198.18.1.2")]))
    assert model.dirty == {HTTP} and model.has_dirty
    state = model.resolve()
    assert state.changed == {HTTP} and not model.has_dirty
    assert addrs(state.ports[HTTP].cluster_endpoints) == ["198.18.1.1:8080", "198.18.1.2:8080"]
    assert addrs(state.ports[METRICS].cluster_endpoints) == ["198.18.1.1:9090"]


def test_reapplying_the_same_object_marks_nothing() -> None:
    objs = [node(), service(ports=TWO_PORTS), eps_slice("s1", [ep("198.18.1.1")])]
    model = model_of(*objs)
    model.resolve()
    for obj in objs:
        again = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "99"}}
        apply_object(model, again)
    assert model.dirty == set()
    state = model.resolve()
    assert state.changed == frozenset()
    assert len(state) == 2


def test_change_with_same_result_is_not_reported_as_changed() -> None:
    model = model_of(node(), service(), eps_slice("s1", [ep("198.18.1.1", zone="zone-a")]))
    model.resolve()
    # A new zone re-resolves every port, but this service uses no topology.
    apply_object(model, node(zone="zone-b"))
    assert model.dirty == {HTTP}
    assert model.resolve().changed == frozenset()


def test_service_delete_removes_its_ports_and_slices_stay_for_its_return() -> None:
    model = model_of(node(), service(ports=TWO_PORTS), eps_slice("s1", [ep("198.18.1.1")]))
    model.resolve()
    delete_object(model, "Service", "ns", "svc")
    state = model.resolve()
    assert len(state) == 0 and state.changed == {HTTP, METRICS}
    apply_object(model, service(ports=TWO_PORTS))
    state = model.resolve()
    assert addrs(state.ports[HTTP].cluster_endpoints) == ["198.18.1.1:8080"]


def test_slice_relabelled_to_another_service_moves() -> None:
    other = service(name="other", ips=("198.18.128.2",))
    model = model_of(node(), service(), other, eps_slice("s1", [ep("198.18.1.1")]))
    model.resolve()
    apply_object(model, eps_slice("s1", [ep("198.18.1.1")], service_name="other"))
    state = model.resolve()
    other_key = ServicePortKey("ns", "other", "http", Family.V4)
    assert state.changed == {HTTP, other_key}
    assert state.ports[HTTP].cluster_endpoints == ()
    assert addrs(state.ports[other_key].cluster_endpoints) == ["198.18.1.1:8080"]


def test_node_zone_change_re_resolves() -> None:
    model = model_of(node(zone="zone-a"), service(trafficDistribution="PreferSameZone"),
                     eps_slice("s1", [ep("198.18.1.1", zone="zone-a"),
                                      ep("198.18.1.2", zone="zone-b")]))
    assert addrs(model.resolve().ports[HTTP].cluster_endpoints) == ["198.18.1.1:8080"]
    apply_object(model, node(zone="zone-b"))
    state = model.resolve()
    assert state.changed == {HTTP}
    assert addrs(state.ports[HTTP].cluster_endpoints) == ["198.18.1.2:8080"]


def test_services_not_ours_are_skipped_with_a_reason() -> None:
    model = model_of(
        node(),
        service(name="headless", ips=("None",)),
        service(name="ext", ips=(), type="ExternalName", externalName="db.example"),
        service(name="theirs", labels={"service.kubernetes.io/service-proxy-name": "other"}),
        service(name="broken", ips=("not-an-ip",)),
    )
    assert len(model.resolve()) == 0
    reasons = {(s.name, s.reason) for s in model.skipped()}
    assert reasons == {("headless", "headless"), ("ext", "external-name"),
                       ("theirs", "other-proxy"), ("broken", "invalid-ip"),
                       ("broken", "no-cluster-ip")}


def test_service_proxy_name_ours() -> None:
    model = ClusterModel(NODE, proxy_name="sliceproxy")
    apply_object(model, service(labels={"service.kubernetes.io/service-proxy-name": "sliceproxy"}))
    assert HTTP in model.resolve().ports


def test_service_turning_headless_removes_it() -> None:
    model = model_of(node(), service(), eps_slice("s1", [ep("198.18.1.1")]))
    assert HTTP in model.resolve().ports
    apply_object(model, service(ips=("None",)))
    state = model.resolve()
    assert HTTP not in state.ports and state.changed == {HTTP}


def test_object_that_stops_decoding_is_removed_and_explained() -> None:
    model = model_of(node(), service(), eps_slice("s1", [ep("198.18.1.1")]))
    model.resolve()
    bad = eps_slice("s1", [ep("198.18.1.1")])
    bad["addressType"] = "IPv5"
    apply_object(model, bad)
    assert model.resolve().ports[HTTP].cluster_endpoints == ()
    assert [s.reason for s in model.skipped()] == ["unknown-address-type"]
    apply_object(model, eps_slice("s1", [ep("198.18.1.1")]))  # fixed: record goes away
    assert model.skipped() == []


# --- property: incremental resolution equals resolving the final objects from scratch ------

SERVICES = ["a", "b"]
SLICES = ["s1", "s2", "s3"]


def svc_variant(name: str, variant: int) -> dict[str, Any]:
    ports = TWO_PORTS if variant % 2 else TWO_PORTS[:1]
    spec: dict[str, Any] = {}
    if variant == 2:
        spec["internalTrafficPolicy"] = "Local"
    if variant == 3:
        spec["trafficDistribution"] = "PreferSameZone"
    ips = ("198.18.128.1", "fd00::1") if variant == 3 else ("198.18.128.1",)
    return service(name=name, ips=ips, ports=ports, **spec)


def slice_variant(name: str, service_name: str, eps: list[tuple[int, bool, str]]) -> dict[str, Any]:
    port = "http" if name != "s3" else "metrics"
    number = 8080 if name != "s3" else 9090
    return eps_slice(
        name,
        [ep(f"198.18.1.{i}", ready=r, node=n, zone="zone-a" if i % 2 else "zone-b")
         for i, r, n in eps],
        service_name=service_name,
        ports=({"name": port, "port": number},),
    )


op_st = st.one_of(
    st.tuples(st.just("svc"), st.sampled_from(SERVICES), st.integers(0, 3)),
    st.tuples(st.just("del-svc"), st.sampled_from(SERVICES)),
    st.tuples(
        st.just("slice"), st.sampled_from(SLICES), st.sampled_from(SERVICES),
        st.lists(st.tuples(st.integers(1, 6), st.booleans(), st.sampled_from([NODE, "node-b"])),
                 max_size=4),
    ),
    st.tuples(st.just("del-slice"), st.sampled_from(SLICES)),
    st.tuples(st.just("node"), st.sampled_from(["zone-a", "zone-b"])),
    st.tuples(st.just("resolve")),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(op_st, max_size=25))
def test_incremental_equals_from_scratch(ops: list[tuple[Any, ...]]) -> None:
    model = ClusterModel(NODE)
    live: dict[tuple[str, str], dict[str, Any]] = {}
    for op in ops:
        match op:
            case ("svc", name, variant):
                obj = svc_variant(name, variant)
                live[("Service", name)] = obj
                apply_object(model, obj)
            case ("del-svc", name):
                live.pop(("Service", name), None)
                delete_object(model, "Service", "ns", name)
            case ("slice", name, svc_name, eps):
                obj = slice_variant(name, svc_name, eps)
                live[("EndpointSlice", name)] = obj
                apply_object(model, obj)
            case ("del-slice", name):
                live.pop(("EndpointSlice", name), None)
                delete_object(model, "EndpointSlice", "ns", name)
            case ("node", zone):
                live[("Node", NODE)] = node(zone=zone)
                apply_object(model, node(zone=zone))
            case ("resolve",):
                model.resolve()
    incremental = model.resolve()
    scratch = model_of(*live.values()).resolve()
    assert dict(incremental.ports) == dict(scratch.ports)
    # Selection never invents endpoints, and the cluster set is empty only when nothing
    # is ready or serving-and-terminating.
    for rsp in incremental:
        listed = {
            (f"198.18.1.{e['addresses'][0].rsplit('.', 1)[1]}", obj["ports"][0]["port"])
            for (kind, _), obj in live.items() if kind == "EndpointSlice"
            and obj["metadata"]["labels"]["kubernetes.io/service-name"] == rsp.key.name
            for e in obj["endpoints"]
        }
        for sel in rsp.endpoints:
            assert (str(sel.endpoint.address), sel.endpoint.port) in listed
        if rsp.uses_cluster:
            assert bool(rsp.cluster_endpoints) == rsp.has_any_endpoints
