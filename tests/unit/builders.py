"""Readable builders for API objects (as dicts, the way the API server sends them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from proxy.kube.ingest import EndpointsSource, apply_object
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.tracker import ClusterModel
from proxy.model.types import Endpoint, Family, IPAddress, ServicePortKey

if TYPE_CHECKING:
    # Imported where used: the kernel lab's scenarios import these builders, and
    # hypothesis costs seconds to import in an emulated guest.
    from hypothesis import strategies as st

NODE = "node-a"
ZONE = "zone-a"


def service(
    name: str = "svc",
    namespace: str = "ns",
    ips: tuple[str, ...] = ("198.18.128.1",),
    ports: tuple[dict[str, Any], ...] = ({"name": "http", "port": 80},),
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {"clusterIPs": list(ips), "ports": [dict(p) for p in ports]}
    if ips:
        body["clusterIP"] = ips[0]
    body.update(spec)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace,
                     "annotations": annotations or {}, "labels": labels or {}},
        "spec": body,
    }


def ep(
    ip: str,
    node: str | None = None,
    zone: str | None = None,
    ready: bool | None = True,
    serving: bool | None = None,
    terminating: bool | None = None,
    zones: tuple[str, ...] | None = None,
    nodes: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    cond: dict[str, Any] = {}
    if ready is not None:
        cond["ready"] = ready
    if serving is not None:
        cond["serving"] = serving
    if terminating is not None:
        cond["terminating"] = terminating
    out: dict[str, Any] = {"addresses": [ip], "conditions": cond}
    if node:
        out["nodeName"] = node
    if zone:
        out["zone"] = zone
    hints: dict[str, Any] = {}
    if zones is not None:
        hints["forZones"] = [{"name": z} for z in zones]
    if nodes is not None:
        hints["forNodes"] = [{"name": n} for n in nodes]
    if hints:
        out["hints"] = hints
    return out


def eps_slice(
    name: str,
    endpoints: list[dict[str, Any]],
    service_name: str = "svc",
    namespace: str = "ns",
    ports: tuple[dict[str, Any], ...] = ({"name": "http", "port": 8080},),
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service_name}},
        "addressType": address_type,
        "ports": [dict(p) for p in ports],
        "endpoints": endpoints,
    }


def node(name: str = NODE, zone: str | None = ZONE,
         addresses: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """`addresses`: status.addresses as (type, address), as a kubelet writes them."""
    labels = {"kubernetes.io/hostname": name}
    if zone:
        labels["topology.kubernetes.io/zone"] = zone
    out: dict[str, Any] = {"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": name, "labels": labels}}
    if addresses:
        out["status"] = {"addresses": [{"type": t, "address": a} for t, a in addresses]}
    return out


def model_of(
    *objects: dict[str, Any],
    node_name: str = NODE,
    source: EndpointsSource = EndpointsSource.ENDPOINT_SLICES,
) -> ClusterModel:
    model = ClusterModel(node_name)
    for obj in objects:
        apply_object(model, obj, source)
    return model


def resolve_one(
    *objects: dict[str, Any],
    port: str = "http",
    family: Family = Family.V4,
    node_name: str = NODE,
    source: EndpointsSource = EndpointsSource.ENDPOINT_SLICES,
) -> ResolvedServicePort:
    model = model_of(*objects, node_name=node_name, source=source)
    state = model.resolve()
    found = state.get(ServicePortKey("ns", "svc", port, family))
    assert found is not None, f"svc:{port} not resolved; have {list(state.ports)}"
    return found


def addrs(eps: Any) -> list[str]:
    return sorted(str(e) for e in eps)


def endpoints_from(addresses: Sequence[IPAddress]) -> st.SearchStrategy[Endpoint]:
    """Hypothesis: endpoints at one of `addresses`, every condition, node and zone
    combination (the merge and memo properties draw slices of these)."""
    from hypothesis import strategies as st

    return st.builds(
        Endpoint,
        address=st.sampled_from(list(addresses)),
        ready=st.booleans(),
        serving=st.booleans(),
        terminating=st.booleans(),
        node_name=st.sampled_from([None, "node-a", "node-b"]),
        zone=st.sampled_from([None, "zone-a", "zone-b"]),
        zone_hints=st.sampled_from([(), ("zone-a",), ("zone-a", "zone-b")]),
    )
