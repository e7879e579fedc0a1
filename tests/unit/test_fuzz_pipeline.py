"""Fuzzing the whole pipeline: arbitrary JSON, biased toward the shapes of Services,
EndpointSlices, Endpoints and Nodes -> decode -> model (tracker, resolve) -> every
renderer. For every example, each object is either decoded or skipped with a reason,
nothing raises, and what the renderers produce is valid kernel input (the checks in
tests/corpus/pipeline.py: the iptables text replays through our iptables-restore model
and every token of every rule is grammatical, addresses canonical and usable; IPVS
servers, addresses and ipset entries valid). nftables joins through
`pipeline.render_all` when its renderer lands.

Examples are valid objects mutated at random paths (a field replaced by arbitrary JSON
or a hostile string, deleted, or a new one added), or arbitrary JSON outright.

CI runs a few hundred examples, derandomized. A long run:

    SLICEPROXY_FUZZ_EXAMPLES=100000 nice .venv/bin/python -m pytest -q \\
        tests/unit/test_fuzz_pipeline.py --hypothesis-show-statistics
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.kube.decode import (
    decode_endpoint_slice,
    decode_endpoints,
    decode_node,
    decode_service,
)
from proxy.kube.ingest import EndpointsSource
from tests.corpus import hostile, pipeline
from tests.corpus.hostile import port

LONG = int(os.environ.get("SLICEPROXY_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=LONG or 300,
    derandomize=not LONG,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)

DECODERS: dict[str, Callable[[Any], tuple[Any, list[Any]]]] = {
    "Service": decode_service,
    "EndpointSlice": decode_endpoint_slice,
    "Endpoints": decode_endpoints,
    "Node": decode_node,
}

# --- values --------------------------------------------------------------------------------

HOSTILE_STRINGS = [
    *hostile.INJECTIONS, *hostile.V4_SPECIAL, *hostile.V6_SPECIAL,
    "::ffff:198.18.1.10", "198.018.001.010", "fe80::1%eth0", "fd00:18:1::10%x -j ACCEPT",
    "198.18.1.10/24", "0.0.0.0/0", "::/0", "010.0.0.0/8", "198.18.0.0/15%eth0",
    "None", "", " ", "TCP", "UDP", "SCTP", "tcp", "ICMP", "IPv4", "IPv6", "FQDN", "Local",
    "Cluster", "ClientIP", "LoadBalancer", "NodePort", "ExternalName", "PreferClose",
    "PreferSameNode", "node-a", "zone-a", "http", "web", "a" * 64, "a" * 254,
    "discovery.k8s.io/v1beta1", "kubernetes.io/service-name", "-", "a.b", "a/b", "a:b",
]
GOOD_STRINGS = ["198.18.1.10", "198.18.1.11", "198.18.128.10", "fd00:18:1::10",
                "fd00:18:128::10", "198.18.0.50", "198.18.0.0/15", "fd00::/8", "web", "http"]

scalars = (
    st.none() | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 80, 8080, 30080, 65535, 65536, 86400, 86401, 10800])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(HOSTILE_STRINGS + GOOD_STRINGS)
    | st.ip_addresses().map(str)
)
FIELDS = [
    "metadata", "name", "namespace", "labels", "annotations", "spec", "status", "ports",
    "port", "protocol", "nodePort", "targetPort", "addresses", "endpoints", "conditions",
    "ready", "serving", "terminating", "addressType", "clusterIPs", "clusterIP", "type",
    "externalIPs", "loadBalancerSourceRanges", "loadBalancer", "ingress", "ip", "ipMode",
    "hostname", "sessionAffinity", "sessionAffinityConfig", "clientIP", "timeoutSeconds",
    "internalTrafficPolicy", "externalTrafficPolicy", "healthCheckNodePort",
    "trafficDistribution", "subsets", "notReadyAddresses", "nodeName", "zone", "hints",
    "forZones", "forNodes", "topology", "kind", "apiVersion", "resourceVersion", "uid",
    "kubernetes.io/service-name", "service.kubernetes.io/headless",
    "service.kubernetes.io/service-proxy-name", "service.kubernetes.io/topology-mode",
    "sliceproxy.io/topology-preference", "topology.kubernetes.io/zone",
    "kubernetes.io/hostname",
]
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


# --- valid objects to start from -------------------------------------------------------------


def bases(source: EndpointsSource) -> list[dict[str, Any]]:
    """A small cluster using most fields the decoder reads, every object valid."""
    ns = "fuzz"
    svc = hostile.service(
        ns, ips=("198.18.128.10", "fd00:18:128::10"),
        ports=(port("http", 80, nodePort=30080), port("dns", 53, "UDP")),
        type="LoadBalancer", externalIPs=["198.18.0.50", "fd00:18::50"],
        loadBalancerSourceRanges=["198.18.0.0/15", "fd00::/8"],
        externalTrafficPolicy="Local", healthCheckNodePort=31000,
        internalTrafficPolicy="Cluster", sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        trafficDistribution="PreferClose",
        annotations={"service.kubernetes.io/topology-mode": "Auto"},
        status={"loadBalancer": {"ingress": [{"ip": "198.18.0.60"}, {"ip": "fd00:18::60"}]}})
    node = hostile.node("node-a")
    sports = (port("http", 8080), port("dns", 5353, "UDP"))
    if source is EndpointsSource.ENDPOINTS:
        eps = hostile.endpoints_object(ns, "web", [{"ip": "198.18.1.10", "nodeName": "node-a"},
                                                   {"ip": "fd00:18:1::10"}], sports)
        eps["subsets"][0]["notReadyAddresses"] = [{"ip": "198.18.1.11"}]
        return [svc, eps, node]
    hints = {"forZones": [{"name": "zone-a"}], "forNodes": [{"name": "node-a"}]}
    v4 = hostile.eslice(ns, "web-v4", [
        hostile.endpoint("198.18.1.10", zone="zone-a", hints=hints),
        hostile.endpoint("198.18.1.11", "node-b", zone="zone-b",
                         conditions={"ready": False, "serving": True, "terminating": True}),
    ], ports=sports)
    v6 = hostile.eslice(ns, "web-v6", [hostile.endpoint("fd00:18:1::10", zone="zone-a")],
                        ports=sports, family="IPv6")
    beta = hostile.eslice(ns, "web-beta", [{"addresses": ["198.18.1.12"],
                                            "conditions": {"ready": True},
                                            "topology": {"kubernetes.io/hostname": "node-a"}}],
                          ports=sports)
    beta["apiVersion"] = "discovery.k8s.io/v1beta1"
    return [svc, v4, v6, beta, node]


# --- mutation --------------------------------------------------------------------------------

Path = tuple[str | int, ...]


def paths(value: Any, prefix: Path = ()) -> list[Path]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


def mutate(data: st.DataObject, obj: dict[str, Any]) -> Any:
    """Replace, delete or add one field somewhere in `obj` (a copy is changed)."""
    target_path = data.draw(st.sampled_from(paths(obj)), label="path")
    op = data.draw(st.sampled_from(["replace", "replace", "delete", "add"]), label="op")
    if not target_path:
        return data.draw(json_values, label="whole") if op == "replace" else obj
    parent: Any = obj
    for step in target_path[:-1]:
        parent = parent[step]
    last = target_path[-1]
    if op == "replace":
        parent[last] = data.draw(json_values | st.sampled_from(HOSTILE_STRINGS), label="new")
    elif op == "delete":
        del parent[last]
    else:
        here = parent[last]
        if isinstance(here, dict):
            here[data.draw(st.sampled_from(FIELDS), label="key")] = data.draw(json_values)
        elif isinstance(here, list):
            here.append(data.draw(json_values | st.sampled_from(GOOD_STRINGS), label="item"))
        else:
            parent[last] = [here, data.draw(json_values, label="item")]
    return obj


def examples(data: st.DataObject) -> tuple[EndpointsSource, list[Any]]:
    source = data.draw(st.sampled_from(list(EndpointsSource)), label="source")
    objects: list[Any] = copy.deepcopy(bases(source))
    if data.draw(st.integers(0, 9), label="arbitrary") == 0:
        kind = data.draw(st.sampled_from(list(DECODERS)), label="kind")
        raw = data.draw(json_values, label="raw")
        if isinstance(raw, dict):
            raw["kind"] = kind
        objects.append(raw)
        return source, objects
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        i = data.draw(st.integers(0, len(objects) - 1), label="object")
        objects[i] = mutate(data, objects[i])
    return source, objects


# --- the properties ------------------------------------------------------------------------------


@FUZZ
@given(st.data())
def test_pipeline_accepts_or_explains_never_raises(data: st.DataObject) -> None:
    source, objects = examples(data)
    for obj in objects:
        kind = obj.get("kind") if isinstance(obj, dict) else None
        decoder = DECODERS.get(kind) if isinstance(kind, str) else None
        if decoder is not None:
            value, skips = decoder(obj)
            assert value is not None or skips, f"{kind} neither decoded nor explained"
            assert all(s.reason for s in skips)
    model, rendered = pipeline.run(objects, source)
    found = pipeline.problems(rendered)
    assert not found, pipeline.first_problems(found)
    for skip in model.skipped():
        assert len(skip.detail) < 400 and len(skip.name) < 300, skip


@FUZZ
@given(json_values)
def test_decoders_never_raise_on_any_json(value: Any) -> None:
    for decoder in DECODERS.values():
        result, skips = decoder(value)
        assert result is not None or skips
