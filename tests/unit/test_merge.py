"""Merging slices per service port and de-duplicating endpoints."""

from __future__ import annotations

from ipaddress import ip_address
from socket import AF_INET6, inet_pton

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.kube import decode
from proxy.kube.ingest import EndpointsSource
from proxy.model.merge import merge_port
from proxy.model.types import Endpoint, EndpointSlice, Family, Protocol, SlicePort
from tests.unit.builders import addrs, endpoints_from, ep, eps_slice, node, resolve_one, service


def test_duplicate_across_slices_collapses_to_the_ready_copy_and_is_reported() -> None:
    rsp = resolve_one(
        node(),
        service(),
        eps_slice("b-slice", [ep("198.18.1.1", ready=True, node="node-a")]),
        eps_slice("a-slice", [ep("198.18.1.1", ready=False, node="node-b"), ep("198.18.1.2")]),
    )
    assert addrs(rsp.cluster_endpoints) == ["198.18.1.1:8080", "198.18.1.2:8080"]
    merged = {str(s.endpoint): s.endpoint for s in rsp.endpoints}
    one = merged["198.18.1.1:8080"]
    assert one.ready and one.node_name == "node-a" and one.conflict
    assert one.sources == ("a-slice", "b-slice")
    [conflict] = rsp.conflicts
    assert conflict.endpoint == "198.18.1.1:8080"
    assert conflict.fields == ("ready", "serving", "node")
    assert conflict.chosen == "b-slice"


def test_identical_duplicates_are_not_conflicts() -> None:
    rsp = resolve_one(
        node(), service(),
        eps_slice("s1", [ep("198.18.1.1")]), eps_slice("s2", [ep("198.18.1.1")]),
    )
    assert len(rsp.endpoints) == 1 and rsp.conflicts == ()
    assert rsp.endpoints[0].endpoint.sources == ("s1", "s2")


def test_equally_available_copies_tie_break_on_slice_name() -> None:
    rsp = resolve_one(
        node(), service(),
        eps_slice("zz", [ep("198.18.1.1", node="node-z")]),
        eps_slice("aa", [ep("198.18.1.1", node="node-a")]),
    )
    assert rsp.endpoints[0].endpoint.node_name == "node-a"
    assert rsp.conflicts[0].chosen == "aa"


def test_named_port_with_different_numbers_in_different_slices() -> None:
    rsp = resolve_one(
        node(), service(),
        eps_slice("old", [ep("198.18.1.1")], ports=({"name": "http", "port": 8080},)),
        eps_slice("new", [ep("198.18.1.2"), ep("198.18.1.1")],
                  ports=({"name": "http", "port": 9090},)),
    )
    # Same address on two ports is two endpoints (a rollout changing targetPort).
    assert addrs(rsp.cluster_endpoints) == [
        "198.18.1.1:8080", "198.18.1.1:9090", "198.18.1.2:9090"]
    assert rsp.conflicts == ()


def test_ports_match_by_name_and_protocol() -> None:
    svc = service(ports=({"name": "dns", "port": 53, "protocol": "UDP"},))
    rsp = resolve_one(
        node(), svc,
        eps_slice("s1", [ep("198.18.1.1")],
                  ports=({"name": "dns", "port": 53, "protocol": "TCP"},)),
        eps_slice("s2", [ep("198.18.1.2")],
                  ports=({"name": "dns", "port": 53, "protocol": "UDP"},)),
        port="dns",
    )
    assert addrs(rsp.cluster_endpoints) == ["198.18.1.2:53"]


def test_families_kept_apart_and_fqdn_ignored() -> None:
    objs = (
        node(),
        service(ips=("198.18.128.1", "fd00::80")),
        eps_slice("v4", [ep("198.18.1.1")]),
        eps_slice("v6", [ep("fd00::10")], address_type="IPv6"),
        {**eps_slice("dns", [{"addresses": ["web.example"]}]), "addressType": "FQDN"},
    )
    v4 = resolve_one(*objs, family=Family.V4)
    v6 = resolve_one(*objs, family=Family.V6)
    assert addrs(v4.cluster_endpoints) == ["198.18.1.1:8080"]
    assert [str(ip) for ip in v4.cluster_ips] == ["198.18.128.1"]
    assert addrs(v6.cluster_endpoints) == ["[fd00::10]:8080"]
    assert [str(ip) for ip in v6.cluster_ips] == ["fd00::80"]


def test_endpoints_mode_gives_the_same_sets_as_slices() -> None:
    endpoints_obj = {
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": "svc", "namespace": "ns"},
        "subsets": [{
            "addresses": [{"ip": "198.18.1.1", "nodeName": "node-a"},
                          {"ip": "198.18.1.2", "nodeName": "node-b"}],
            "notReadyAddresses": [{"ip": "198.18.1.3"}],
            "ports": [{"name": "http", "port": 8080}],
        }],
    }
    slice_obj = eps_slice("s1", [ep("198.18.1.1", node="node-a"), ep("198.18.1.2", node="node-b"),
                                 ep("198.18.1.3", ready=False)])
    for spec in ({}, {"internalTrafficPolicy": "Local"}):
        a = resolve_one(node(), service(**spec), endpoints_obj, source=EndpointsSource.ENDPOINTS)
        b = resolve_one(node(), service(**spec), slice_obj)
        assert addrs(a.cluster_endpoints) == addrs(b.cluster_endpoints)
        assert addrs(a.local_endpoints) == addrs(b.local_endpoints)


def test_source_flag_decides_which_kind_is_read() -> None:
    endpoints_obj = {
        "apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "svc", "namespace": "ns"},
        "subsets": [{"addresses": [{"ip": "198.18.1.9"}], "ports": [{"name": "http", "port": 1}]}],
    }
    rsp = resolve_one(node(), service(), eps_slice("s1", [ep("198.18.1.1")]), endpoints_obj)
    assert addrs(rsp.cluster_endpoints) == ["198.18.1.1:8080"]


# --- property: the merge does not depend on the order slices arrived in -------------------

ADDRS = [ip_address(f"198.18.1.{i}") for i in range(1, 6)]
endpoints_st = endpoints_from(ADDRS)


@st.composite
def slice_sets(draw: st.DrawFn) -> list[EndpointSlice]:
    count = draw(st.integers(1, 5))
    names = draw(st.lists(st.sampled_from("abcdefgh"), min_size=count, max_size=count,
                          unique=True))
    return [
        EndpointSlice(
            namespace="ns", name=name, service_name="svc", family=Family.V4,
            ports=(SlicePort("http", Protocol.TCP, draw(st.sampled_from([8080, 9090]))),),
            endpoints=tuple(draw(st.lists(endpoints_st, max_size=6))),
        )
        for name in names
    ]


@settings(max_examples=300, deadline=None)
@given(slice_sets(), st.randoms(use_true_random=False))
def test_merge_is_independent_of_arrival_order(slices: list[EndpointSlice], rnd: object) -> None:
    expected = merge_port(slices, "http", Protocol.TCP, Family.V4)
    shuffled = list(slices)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    # Also reverse each slice's endpoint order: duplicates inside one slice count too.
    shuffled = [
        EndpointSlice(s.namespace, s.name, s.service_name, s.family, s.ports,
                      tuple(reversed(s.endpoints)))
        for s in shuffled
    ]
    assert merge_port(shuffled, "http", Protocol.TCP, Family.V4) == expected


@settings(max_examples=300, deadline=None)
@given(slice_sets())
def test_merge_keeps_one_copy_of_each_endpoint_and_prefers_ready(
    slices: list[EndpointSlice],
) -> None:
    merged, _ = merge_port(slices, "http", Protocol.TCP, Family.V4)
    keys = [(m.address, m.port) for m in merged]
    assert len(keys) == len(set(keys))
    listed = {(e.address, s.ports[0].port) for s in slices for e in s.endpoints}
    assert set(keys) == listed
    for m in merged:
        copies = [e for s in slices for e in s.endpoints
                  if (e.address, s.ports[0].port) == (m.address, m.port)]
        assert m.ready == any(e.ready for e in copies)


@settings(max_examples=300, deadline=None)
@given(slice_sets())
def test_one_slice_merges_as_the_general_path_does(slices: list[EndpointSlice]) -> None:
    """A port one slice lists takes a shortcut (`_one_listing`, unless an address
    repeats); a second, empty slice listing the port sends the same endpoints through
    the general path: the same endpoints, copies, sources and conflicts."""
    one = slices[0]
    empty = EndpointSlice(one.namespace, "zz-empty", one.service_name, one.family, one.ports,
                          ())
    assert merge_port([one], "http", Protocol.TCP, Family.V4) \
        == merge_port([one, empty], "http", Protocol.TCP, Family.V4)


@pytest.mark.parametrize(("family", "ips", "unordered"), [
    (Family.V4, ("198.18.0.9", "198.18.0.10", "198.18.0.255", "198.18.1.0"), False),
    (Family.V4, ("198.18.0.9", "198.18.0.10", "198.18.0.255", "198.18.1.0"), True),
    (Family.V6, ("fd00::9", "fd00::a", "fd00::ff", "fd00::1:0"), False),
    (Family.V6, ("fd00::9", "fd00::a", "fd00::ff", "fd00::1:0"), True),
])
def test_endpoints_are_ordered_by_address_as_a_number(
        family: Family, ips: tuple[str, ...], unordered: bool) -> None:
    # One slice (its own path) or two listing one address twice (the general one); in
    # the order of the addresses' numbers, not their text ("198.18.0.10" < "...0.9").
    kind = "IPv4" if family is Family.V4 else "IPv6"
    shuffled = [ep(ip) for ip in reversed(ips)]
    slices = [eps_slice("a", shuffled, address_type=kind)]
    if unordered:
        slices.append(eps_slice("b", [ep(ips[2])], address_type=kind))
    cluster_ip = "198.18.128.1" if family is Family.V4 else "fd00:128::1"
    rsp = resolve_one(node(), service(ips=(cluster_ip,)), *slices, family=family)
    assert [s.address for s in rsp.endpoints] == [ip_address(ip) for ip in ips]
    assert [s.endpoint.sources for s in rsp.endpoints][2] == (("a", "b") if unordered else ("a",))


def test_an_endpoint_is_the_same_from_its_text_or_its_address_object() -> None:
    # The fast decoder makes endpoints from packed bytes, everything else from address
    # objects: the two must be equal, hash alike and read back the same address.
    raw = {"addresses": ["fd00::1:2"], "conditions": {"ready": True}, "nodeName": "n"}
    fast = decode._plain_slice_endpoint(raw, False, v4=False)
    made = Endpoint(ip_address("fd00::1:2"), node_name="n")
    assert fast == made and hash(fast) == hash(made)
    assert fast.address == ip_address("fd00::1:2")
    assert fast.packed == inet_pton(AF_INET6, "fd00::1:2")
    assert fast != Endpoint(ip_address("fd00::1:3"), node_name="n")
    assert "fd00::1:2" in repr(fast)
