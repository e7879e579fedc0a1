"""Decoding: good objects become model types; bad input becomes a skip record, never a crash."""

from __future__ import annotations

import copy
from ipaddress import ip_address, ip_network
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.kube.decode import (
    decode_endpoint_slice,
    decode_endpoints,
    decode_node,
    decode_service,
)
from proxy.model.types import Family, Protocol, ServiceType, TrafficPolicy
from tests.unit.builders import ep, eps_slice, node, service


def test_service_fields() -> None:
    obj = service(
        ips=("198.18.128.1", "fd00::1"),
        ports=({"name": "http", "port": 80, "nodePort": 30080},
               {"name": "dns", "port": 53, "protocol": "UDP"}),
        type="LoadBalancer",
        externalIPs=["198.19.0.5"],
        loadBalancerSourceRanges=["198.18.200.0/24"],
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        externalTrafficPolicy="Local",
        healthCheckNodePort=31000,
        trafficDistribution="PreferClose",
        annotations={"sliceproxy.io/topology-preference": " kubernetes.io/hostname , * ,"},
    )
    obj["status"] = {"loadBalancer": {"ingress": [
        {"ip": "198.19.0.9"}, {"hostname": "lb.example"}, {"ip": "198.19.0.10", "ipMode": "Proxy"},
    ]}}
    svc, skips = decode_service(obj)
    assert skips == []
    assert svc is not None
    assert svc.type is ServiceType.LOAD_BALANCER
    assert svc.cluster_ips == (ip_address("198.18.128.1"), ip_address("fd00::1"))
    assert svc.families() == (Family.V4, Family.V6)
    assert [(p.name, p.protocol, p.port, p.node_port) for p in svc.ports] == [
        ("http", Protocol.TCP, 80, 30080), ("dns", Protocol.UDP, 53, 0)]
    assert svc.external_ips == (ip_address("198.19.0.5"),)
    assert svc.load_balancer_ips == (ip_address("198.19.0.9"),)  # Proxy-mode IP not captured
    assert svc.load_balancer_source_ranges == (ip_network("198.18.200.0/24"),)
    assert svc.affinity_timeout == 60
    assert svc.external_traffic_policy is TrafficPolicy.LOCAL
    assert svc.internal_traffic_policy is TrafficPolicy.CLUSTER
    assert svc.health_check_node_port == 31000
    assert svc.traffic_distribution == "PreferClose"
    assert svc.topology_preference == ("kubernetes.io/hostname", "*")


def test_client_ip_affinity_default_timeout() -> None:
    svc, _ = decode_service(service(sessionAffinity="ClientIP"))
    assert svc is not None and svc.affinity_timeout == 10800


def test_headless_and_external_name_decode_but_are_flagged() -> None:
    svc, skips = decode_service(service(ips=("None",)))
    assert svc is not None and svc.headless and svc.cluster_ips == () and skips == []
    svc, _ = decode_service(service(ips=(), type="ExternalName", externalName="x.example"))
    assert svc is not None and svc.type is ServiceType.EXTERNAL_NAME


@pytest.mark.parametrize(
    ("mutate", "reason", "part"),
    [
        (lambda o: o["spec"]["ports"].append({"port": 70000}), "invalid-port", "spec.ports[1]"),
        (lambda o: o["spec"]["ports"].append({"port": 81, "protocol": "ICMP"}),
         "unknown-protocol", "spec.ports[1]"),
        (lambda o: o["spec"].update(clusterIPs=["198.18.128.1", "300.1.1.1"]),
         "invalid-ip", "spec.clusterIPs[1]"),
        (lambda o: o["spec"].update(externalIPs=["nope"]), "invalid-ip", "spec.externalIPs[0]"),
        (lambda o: o["spec"].update(loadBalancerSourceRanges=["1.2.3.0/33"]),
         "invalid-cidr", "spec.loadBalancerSourceRanges[0]"),
        (lambda o: o["spec"].update(internalTrafficPolicy="Nearby"),
         "invalid-value", "spec.internalTrafficPolicy"),
    ],
)
def test_service_bad_parts_are_skipped_rest_kept(mutate: Any, reason: str, part: str) -> None:
    obj = service()
    mutate(obj)
    svc, skips = decode_service(obj)
    assert svc is not None
    assert svc.ports[0].port == 80  # the good part survives
    assert [(s.reason, s.part) for s in skips] == [(reason, part)]


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ("not an object", "malformed"),
        ({"kind": "Service"}, "missing-field"),
        ({"metadata": {"name": "x"}, "spec": {"type": "Weird"}}, "invalid-value"),
        ({"metadata": {"name": "x"}, "spec": {"ports": "80"}}, "malformed"),
    ],
)
def test_service_unusable_is_skipped_whole(obj: Any, reason: str) -> None:
    svc, skips = decode_service(obj)
    assert svc is None
    assert [s.reason for s in skips] == [reason]
    assert skips[0].part == ""


def test_slice_fields_and_condition_defaults() -> None:
    obj = eps_slice("s1", [
        ep("198.18.1.1", node="n1", zone="z1", ready=None, zones=("z1",), nodes=("n1",)),
        ep("198.18.1.2", ready=False, terminating=True),
        ep("198.18.1.3", ready=False, serving=True, terminating=True),
    ], ports=({"name": "http", "port": 8080}, {"name": "dns", "port": 53, "protocol": "UDP"}))
    sl, skips = decode_endpoint_slice(obj)
    assert skips == [] and sl is not None
    assert sl.service_name == "svc" and sl.family is Family.V4
    assert [(p.name, p.protocol, p.port) for p in sl.ports] == [
        ("http", Protocol.TCP, 8080), ("dns", Protocol.UDP, 53)]
    e1, e2, e3 = sl.endpoints
    assert (e1.ready, e1.serving, e1.terminating) == (True, True, False)
    assert (e1.node_name, e1.zone, e1.zone_hints, e1.node_hints) == ("n1", "z1", ("z1",), ("n1",))
    assert (e2.ready, e2.serving, e2.terminating) == (False, False, True)  # serving follows ready
    assert (e3.ready, e3.serving, e3.terminating) == (False, True, True)


def test_slice_uses_first_address_only() -> None:
    obj = eps_slice("s1", [{"addresses": ["198.18.1.1", "198.18.1.2"]}])
    sl, _ = decode_endpoint_slice(obj)
    assert sl is not None and [str(e.address) for e in sl.endpoints] == ["198.18.1.1"]


def test_v1beta1_slice_topology_map() -> None:
    obj = eps_slice("s1", [])
    obj["apiVersion"] = "discovery.k8s.io/v1beta1"
    obj["endpoints"] = [{"addresses": ["198.18.1.1"], "conditions": {"ready": True},
                         "topology": {"kubernetes.io/hostname": "n1",
                                      "topology.kubernetes.io/zone": "z1"}}]
    sl, _ = decode_endpoint_slice(obj)
    assert sl is not None
    assert (sl.endpoints[0].node_name, sl.endpoints[0].zone) == ("n1", "z1")


@pytest.mark.parametrize(
    ("endpoint", "port", "reason", "part"),
    [
        (ep("198.18.1.999"), {"name": "http", "port": 8080}, "invalid-ip", "endpoints[1]"),
        (ep("fd00::1"), {"name": "http", "port": 8080}, "invalid-ip", "endpoints[1]"),
        ({"addresses": []}, {"name": "http", "port": 8080}, "missing-field", "endpoints[1]"),
        (ep("198.18.1.2"), {"name": "x", "port": 0}, "invalid-port", "ports[1]"),
        (ep("198.18.1.2"), {"name": "x", "port": None}, "missing-field", "ports[1]"),
        (ep("198.18.1.2"), {"name": "x", "port": 1, "protocol": "GRE"},
         "unknown-protocol", "ports[1]"),
    ],
)
def test_slice_bad_endpoint_or_port_skipped(
    endpoint: dict[str, Any], port: dict[str, Any], reason: str, part: str
) -> None:
    good = ep("198.18.1.1")
    if part.startswith("endpoints"):
        obj = eps_slice("s1", [good, endpoint])
    else:
        obj = eps_slice("s1", [good], ports=({"name": "http", "port": 8080}, port))
    sl, skips = decode_endpoint_slice(obj)
    assert sl is not None
    assert [str(e.address) for e in sl.endpoints] == ["198.18.1.1"]
    assert [p.name for p in sl.ports] == ["http"]
    assert [(s.reason, s.part) for s in skips] == [(reason, part)]


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda o: o["metadata"].pop("labels"), "missing-service-name-label"),
        (lambda o: o.update(addressType="FQDN"), "unsupported-address-type"),
        (lambda o: o.update(addressType="IPv5"), "unknown-address-type"),
        (lambda o: o["metadata"]["labels"].update({"service.kubernetes.io/headless": ""}),
         "headless"),
        (lambda o: o.update(endpoints={"a": 1}), "malformed"),
    ],
)
def test_slice_skipped_whole(mutate: Any, reason: str) -> None:
    obj = eps_slice("s1", [ep("198.18.1.1")])
    mutate(obj)
    sl, skips = decode_endpoint_slice(obj)
    assert sl is None
    assert [s.reason for s in skips] == [reason]


def test_endpoints_become_pseudo_slices_per_subset_and_family() -> None:
    obj = {
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": "svc", "namespace": "ns"},
        "subsets": [
            {"addresses": [{"ip": "198.18.1.1", "nodeName": "n1"}, {"ip": "fd00::1"}],
             "notReadyAddresses": [{"ip": "198.18.1.2"}],
             "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]},
            {"addresses": [{"ip": "198.18.1.3"}, {"ip": "bogus"}],
             "ports": [{"name": "http", "port": 9090}]},
        ],
    }
    slices, skips = decode_endpoints(obj)
    assert slices is not None
    assert [(s.name, s.family, s.service_name) for s in slices] == [
        ("svc#0/IPv4", Family.V4, "svc"), ("svc#0/IPv6", Family.V6, "svc"),
        ("svc#1/IPv4", Family.V4, "svc")]
    v4 = slices[0]
    assert [(str(e.address), e.ready, e.serving, e.node_name) for e in v4.endpoints] == [
        ("198.18.1.1", True, True, "n1"), ("198.18.1.2", False, False, None)]
    assert [(s.reason, s.part) for s in skips] == [("invalid-ip", "subsets[1].addresses[1]")]


def test_node_labels() -> None:
    n, skips = decode_node(node("node-a", "zone-a"))
    assert skips == [] and n is not None
    assert n.zone == "zone-a" and n.label("kubernetes.io/hostname") == "node-a"


def test_resource_version_does_not_affect_equality() -> None:
    a = service()
    b = copy.deepcopy(a)
    b["metadata"]["resourceVersion"] = "42"
    assert decode_service(a)[0] == decode_service(b)[0]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-70000, 70000) | st.text(max_size=12)
    | st.sampled_from(["198.18.1.1", "fd00::1", "None", "TCP", "UDP", "IPv4", "IPv6",
                       "Local", "ClientIP", "http"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["metadata", "name", "namespace", "labels", "spec", "ports", "port",
                         "protocol", "addresses", "endpoints", "conditions", "ready",
                         "addressType", "clusterIPs", "clusterIP", "subsets", "ip", "hints",
                         "forZones", "kubernetes.io/service-name", "nodePort", "type"]),
        inner, max_size=6),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_decoders_never_raise(value: Any) -> None:
    for decoder in (decode_service, decode_endpoint_slice, decode_endpoints, decode_node):
        result, skips = decoder(value)
        assert result is not None or skips  # an object is either decoded or explained


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_valid_slices_never_raise(data: st.DataObject) -> None:
    obj = eps_slice("s1", [ep("198.18.1.1", node="n", zone="z", zones=("z",))])
    # Replace one field somewhere in a valid object with an arbitrary JSON value.
    path = data.draw(st.sampled_from([
        ("endpoints",), ("endpoints", 0), ("endpoints", 0, "addresses"),
        ("endpoints", 0, "conditions"), ("endpoints", 0, "hints"), ("ports",), ("ports", 0),
        ("ports", 0, "port"), ("metadata", "labels"), ("addressType",), ("metadata",),
    ]))
    target: Any = obj
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = data.draw(json_values)
    result, skips = decode_endpoint_slice(obj)
    assert result is not None or skips
