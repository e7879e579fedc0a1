"""`api_level="1.20"`: EndpointSlices only as discovery.k8s.io/v1beta1, as a v1.20 API
server serves them (discovery, paths, what it stores), and v1 manifests converted on load."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from proxy.sim import SimServer
from tests.sim.client import Api, endpoint_slice, wait_for

BETA = "/apis/discovery.k8s.io/v1beta1/namespaces/default/endpointslices"
V1 = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"


@pytest.fixture
def old() -> Iterator[SimServer]:
    with SimServer(api_level="1.20", bookmark_interval=0.2) as sim:
        yield sim


def beta_slice(name: str, endpoints: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1beta1", "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "endpoints": endpoints,
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}


def test_discovery_offers_only_v1beta1(old: SimServer) -> None:
    api = Api(old.url)
    assert api.get("/version")[1]["minor"] == "20"
    _, groups = api.get("/apis")
    (discovery,) = [g for g in groups["groups"] if g["name"] == "discovery.k8s.io"]
    assert [v["version"] for v in discovery["versions"]] == ["v1beta1"]
    assert discovery["preferredVersion"]["groupVersion"] == "discovery.k8s.io/v1beta1"
    status, group = api.get("/apis/discovery.k8s.io")
    assert status == 200 and [v["version"] for v in group["versions"]] == ["v1beta1"]
    _, resources = api.get("/apis/discovery.k8s.io/v1beta1")
    assert [r["name"] for r in resources["resources"]] == ["endpointslices"]
    assert api.get("/apis/discovery.k8s.io/v1")[0] == 404
    assert api.get(V1)[0] == 404
    assert api.post(V1, endpoint_slice("v1", "web", ["198.18.0.1"]))[0] == 404


def test_latest_level_offers_only_v1() -> None:
    with SimServer() as sim:
        api = Api(sim.url)
        _, group = api.get("/apis/discovery.k8s.io")
        assert [v["version"] for v in group["versions"]] == ["v1"]
        assert api.get(BETA)[0] == 404


def test_stores_what_a_120_server_keeps(old: SimServer) -> None:
    api = Api(old.url)
    status, created = api.post(BETA, beta_slice("web-1", [
        {"addresses": ["198.18.0.1"], "conditions": {"ready": True, "serving": True},
         "topology": {"kubernetes.io/hostname": "node-a",
                      "topology.kubernetes.io/zone": "zone-a"},
         "nodeName": "node-a", "zone": "zone-a", "hints": {"forZones": [{"name": "zone-a"}]}},
    ]))
    assert status == 201, created
    assert created["apiVersion"] == "discovery.k8s.io/v1beta1"
    # nodeName and serving were alpha-gated (off), zone and hints did not exist yet.
    assert created["endpoints"] == [
        {"addresses": ["198.18.0.1"], "conditions": {"ready": True},
         "topology": {"kubernetes.io/hostname": "node-a",
                      "topology.kubernetes.io/zone": "zone-a"}}]
    status, listed = api.get("/apis/discovery.k8s.io/v1beta1/endpointslices")
    assert status == 200 and listed["apiVersion"] == "discovery.k8s.io/v1beta1"
    assert listed["kind"] == "EndpointSliceList"


def test_topology_is_validated_like_labels(old: SimServer) -> None:
    status, body = Api(old.url).post(BETA, beta_slice("bad", [
        {"addresses": ["198.18.0.1"], "topology": {"kubernetes.io/hostname": "no/slash"}}]))
    assert status == 422
    assert body["details"]["causes"][0]["field"] == "endpoints[0].topology"


def test_v1_manifests_are_converted_on_load() -> None:
    v1 = endpoint_slice("conv", "web", ["198.18.0.1", "198.18.0.2"])
    v1["endpoints"][0].update(nodeName="node-a", zone="zone-a")
    with SimServer(api_level="1.20", objects=[v1]) as sim:
        got = sim.get("discovery.k8s.io/v1beta1", "EndpointSlice", "conv")
    assert got["endpoints"] == [
        {"addresses": ["198.18.0.1"], "conditions": {"ready": True},
         "topology": {"kubernetes.io/hostname": "node-a",
                      "topology.kubernetes.io/zone": "zone-a"}},
        {"addresses": ["198.18.0.2"], "conditions": {"ready": True}}]


def test_watch_v1beta1(old: SimServer) -> None:
    api = Api(old.url)
    _, listed = api.get(BETA)
    with api.watch(BETA, resourceVersion=listed["metadata"]["resourceVersion"],
                   allowWatchBookmarks="true") as w:
        wait_for(lambda: old.open_watches() == 1, what="watch registered")
        api.post(BETA, beta_slice("w", [{"addresses": ["198.18.0.9"]}]))
        added, mark = w.take(2)
    assert added["type"] == "ADDED"
    assert added["object"]["apiVersion"] == "discovery.k8s.io/v1beta1"
    assert mark["object"]["apiVersion"] == "discovery.k8s.io/v1beta1"


def test_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported API level"):
        SimServer(api_level="1.99")
