"""Upstream kube-proxy's `TestCategorizeEndpoints` table, case by case, through our model.

Source: kubernetes/kubernetes `pkg/proxy/topology_test.go` (the 26-case table at commit
6c039d9075ef18d200bb0ba7dbdb362f4d0deef0), which checks `CategorizeEndpoints` in
`pkg/proxy/topology.go`. Each case below restates one upstream case in our own terms:
API objects (a Node, a Service, one EndpointSlice) go through the real path (decode ->
model -> selection), and we check what upstream checks:

* the cluster set, or that the service port never uses one (upstream: nil);
* the local set, or that it never uses one;
* every endpoint this node can reach (upstream's allReachableEndpoints: the union);
* whether the service has usable endpoints anywhere (upstream's hasAnyEndpoints), which
  decides between dropping (Local policy, none here) and rejecting (none anywhere).

Upstream marks an endpoint `isLocal`; here a local endpoint has this node's nodeName and
a remote one another node's. Upstream's `ready: true` endpoints leave serving unset; we
leave it to the API default (serving follows ready), which selection never consults for
a ready endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.unit.builders import NODE, addrs, ep, eps_slice, resolve_one, service

REMOTE = "node-b"


def e(address: str, *, local: bool = False, ready: bool = True,
      serving: bool | None = None, terminating: bool | None = None,
      zones: tuple[str, ...] | None = None) -> dict[str, Any]:
    """One upstream BaseEndpointInfo as an EndpointSlice endpoint (port 80)."""
    return ep(address, node=NODE if local else REMOTE, ready=ready, serving=serving,
              terminating=terminating, zones=zones)


@dataclass(frozen=True)
class Case:
    name: str  # upstream's test case name, verbatim
    endpoints: tuple[dict[str, Any], ...]
    # Expected sets; None: the service port never uses that set (upstream's nil).
    cluster: tuple[str, ...] | None
    local: tuple[str, ...] | None
    # Upstream's allEndpoints, given only when both sets are in use.
    all: tuple[str, ...] | None = None
    only_remote: bool = False  # usable endpoints exist, none reachable from here
    zone: str | None = None  # this node's topology.kubernetes.io/zone label (None: absent)
    internal_local: bool = False
    external_local: bool = False
    node_port: bool = False

    def expected_all(self) -> tuple[str, ...]:
        if self.all is not None:
            return self.all
        return self.cluster if self.cluster is not None else (self.local or ())


# Upstream's four-endpoint zone-hinted set (10.1.2.3-6, hinted a, b, c, a).
def _zoned(*, ready6: bool = True, ready3: bool = True,
           local3: bool = False, local4: bool = False) -> tuple[dict[str, Any], ...]:
    return (
        e("10.1.2.3", zones=("zone-a",), ready=ready3, local=local3),
        e("10.1.2.4", zones=("zone-b",), local=local4),
        e("10.1.2.5", zones=("zone-c",)),
        e("10.1.2.6", zones=("zone-a",), ready=ready6),
    )


ALL4 = ("10.1.2.3:80", "10.1.2.4:80", "10.1.2.5:80", "10.1.2.6:80")


def term(address: str, *, local: bool = False) -> dict[str, Any]:
    """Not ready, serving and terminating: a pod on its way out."""
    return e(address, local=local, ready=False, serving=True, terminating=True)


CASES = [
    Case("should use topology since all endpoints have hints, node has a zone label and "
         "and there are endpoints for the node's zone",
         _zoned(), cluster=("10.1.2.3:80", "10.1.2.6:80"), local=None, zone="zone-a"),
    Case("externalTrafficPolicy: Local, topology ignored for Local endpoints",
         _zoned(local3=True, local4=True),
         cluster=("10.1.2.3:80", "10.1.2.6:80"), local=("10.1.2.3:80", "10.1.2.4:80"),
         all=("10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"),
         zone="zone-a", external_local=True, node_port=True),
    Case("internalTrafficPolicy: Local, topology ignored for Local endpoints",
         _zoned(local3=True, local4=True),
         cluster=("10.1.2.3:80", "10.1.2.6:80"), local=("10.1.2.3:80", "10.1.2.4:80"),
         all=("10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"),
         zone="zone-a", internal_local=True, node_port=True),
    Case("empty node labels",
         (e("10.1.2.3", zones=("zone-a",)),), cluster=("10.1.2.3:80",), local=None),
    Case("empty zone label",
         (e("10.1.2.3", zones=("zone-a",)),), cluster=("10.1.2.3:80",), local=None, zone=""),
    Case("node in different zone, no endpoint filtering",
         (e("10.1.2.3", zones=("zone-a",)),), cluster=("10.1.2.3:80",), local=None,
         zone="zone-b"),
    Case("unready endpoint",
         _zoned(ready6=False), cluster=("10.1.2.3:80",), local=None, zone="zone-a"),
    Case("only unready endpoints in same zone (should not filter)",
         _zoned(ready3=False, ready6=False), cluster=("10.1.2.4:80", "10.1.2.5:80"),
         local=None, zone="zone-a"),
    Case("missing hints, no filtering applied",
         (e("10.1.2.3", zones=("zone-a",)), e("10.1.2.4", zones=("zone-b",)),
          e("10.1.2.5"), e("10.1.2.6", zones=("zone-a",))),
         cluster=ALL4, local=None, zone="zone-a"),
    Case("multiple hints per endpoint, filtering includes any endpoint with zone included",
         (e("10.1.2.3", zones=("zone-a", "zone-b", "zone-c")),
          e("10.1.2.4", zones=("zone-b", "zone-c")),
          e("10.1.2.5", zones=("zone-b", "zone-d")),
          e("10.1.2.6", zones=("zone-c",))),
         cluster=("10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"), local=None, zone="zone-c"),
    Case("conflicting topology and localness require merging allEndpoints",
         (e("10.0.0.0", zones=("zone-a",), local=True),
          e("10.0.0.1", zones=("zone-b",), local=True),
          e("10.0.0.2", zones=("zone-a",)),
          e("10.0.0.3", zones=("zone-b",))),
         cluster=("10.0.0.0:80", "10.0.0.2:80"), local=("10.0.0.0:80", "10.0.0.1:80"),
         all=("10.0.0.0:80", "10.0.0.1:80", "10.0.0.2:80"),
         zone="zone-a", external_local=True, node_port=True),
    Case("internalTrafficPolicy: Local, with empty endpoints",
         (), cluster=None, local=(), internal_local=True),
    Case("internalTrafficPolicy: Local, but all endpoints are remote",
         (e("10.0.0.0"), e("10.0.0.1")), cluster=None, local=(), only_remote=True,
         internal_local=True),
    Case("internalTrafficPolicy: Local, all endpoints are local",
         (e("10.0.0.0", local=True), e("10.0.0.1", local=True)),
         cluster=None, local=("10.0.0.0:80", "10.0.0.1:80"), internal_local=True),
    Case("internalTrafficPolicy: Local, some endpoints are local",
         (e("10.0.0.0", local=True), e("10.0.0.1")),
         cluster=None, local=("10.0.0.0:80",), internal_local=True),
    Case("Cluster traffic policy, endpoints not Ready",
         (e("10.0.0.0", ready=False), e("10.0.0.1", ready=False)), cluster=(), local=None),
    Case("Cluster traffic policy, some endpoints are Ready",
         (e("10.0.0.0", ready=False), e("10.0.0.1")), cluster=("10.0.0.1:80",), local=None),
    Case("Cluster traffic policy, all endpoints are terminating",
         (term("10.0.0.0", local=True), term("10.0.0.1")),
         cluster=("10.0.0.0:80", "10.0.0.1:80"), local=None),
    Case("iTP: Local, eTP: Cluster, some endpoints local",
         (e("10.0.0.0", local=True), e("10.0.0.1")),
         cluster=("10.0.0.0:80", "10.0.0.1:80"), local=("10.0.0.0:80",),
         all=("10.0.0.0:80", "10.0.0.1:80"), internal_local=True, node_port=True),
    Case("iTP: Cluster, eTP: Local, some endpoints local",
         (e("10.0.0.0", local=True), e("10.0.0.1")),
         cluster=("10.0.0.0:80", "10.0.0.1:80"), local=("10.0.0.0:80",),
         all=("10.0.0.0:80", "10.0.0.1:80"), external_local=True, node_port=True),
    Case("iTP: Local, eTP: Local, some endpoints local",
         (e("10.0.0.0", local=True), e("10.0.0.1")),
         cluster=("10.0.0.0:80", "10.0.0.1:80"), local=("10.0.0.0:80",),
         all=("10.0.0.0:80", "10.0.0.1:80"),
         internal_local=True, external_local=True, node_port=True),
    Case("iTP: Local, eTP: Local, all endpoints remote",
         (e("10.0.0.0"), e("10.0.0.1")),
         cluster=("10.0.0.0:80", "10.0.0.1:80"), local=(),
         all=("10.0.0.0:80", "10.0.0.1:80"),
         internal_local=True, external_local=True, node_port=True),
    Case("iTP: Local, eTP: Local, all endpoints remote and terminating",
         (term("10.0.0.0"), term("10.0.0.1")),
         cluster=("10.0.0.0:80", "10.0.0.1:80"), local=(),
         all=("10.0.0.0:80", "10.0.0.1:80"), only_remote=True,
         internal_local=True, external_local=True, node_port=True),
    Case("iTP: Cluster, eTP: Local, with terminating endpoints",
         (e("10.0.0.0"),
          e("10.0.0.1", local=True, ready=False, serving=False),
          term("10.0.0.2", local=True),
          term("10.0.0.3")),
         cluster=("10.0.0.0:80",), local=("10.0.0.2:80",),
         all=("10.0.0.0:80", "10.0.0.2:80"), external_local=True, node_port=True),
    Case("externalTrafficPolicy ignored if not externally accessible",
         (e("10.0.0.0"), e("10.0.0.1", local=True)),
         cluster=("10.0.0.0:80", "10.0.0.1:80"), local=None,
         all=("10.0.0.0:80", "10.0.0.1:80"), external_local=True),
    Case("no cluster endpoints for iTP:Local internal-only service",
         (e("10.0.0.0"), e("10.0.0.1", local=True)),
         cluster=None, local=("10.0.0.1:80",), all=("10.0.0.1:80",), internal_local=True),
]


def _node(zone: str | None) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": NODE}
    if zone is not None:
        labels["topology.kubernetes.io/zone"] = zone
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": labels}}


def _service(case: Case) -> dict[str, Any]:
    port: dict[str, Any] = {"name": "http", "port": 80}
    if case.node_port:
        port["nodePort"] = 30080
    return service(
        ports=(port,),
        type="NodePort" if case.node_port else "ClusterIP",
        internalTrafficPolicy="Local" if case.internal_local else "Cluster",
        externalTrafficPolicy="Local" if case.external_local else "Cluster",
    )


def test_the_whole_upstream_table_is_here() -> None:
    assert len(CASES) == 26
    assert len({c.name for c in CASES}) == 26


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_categorize_endpoints(case: Case) -> None:
    rsp = resolve_one(
        _node(case.zone),
        _service(case),
        eps_slice("s1", list(case.endpoints), ports=({"name": "http", "port": 80},)),
    )
    got_cluster = addrs(rsp.cluster_endpoints) if rsp.uses_cluster else None
    got_local = addrs(rsp.local_endpoints) if rsp.uses_local else None
    want_cluster = sorted(case.cluster) if case.cluster is not None else None
    want_local = sorted(case.local) if case.local is not None else None
    assert (got_cluster, got_local) == (want_cluster, want_local)

    reachable = addrs({*rsp.cluster_endpoints, *rsp.local_endpoints})
    assert reachable == sorted(case.expected_all())
    assert rsp.has_any_endpoints == (bool(case.expected_all()) or case.only_remote)
