"""Which endpoints a node uses: a table of named cases, upstream's and ours.

Each case goes through the real path (API dicts -> decode -> model -> selection) and
checks the cluster set, the local set and the topology mode a user would see in
`explain`. Upstream's cases follow pkg/proxy/topology_test.go's situations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.unit.builders import NODE, ZONE, addrs, ep, eps_slice, node, resolve_one, service

PREF = "sliceproxy.io/topology-preference"


@dataclass
class Case:
    name: str
    endpoints: list[dict[str, Any]]
    cluster: list[str]
    local: list[str] = field(default_factory=list)
    spec: dict[str, Any] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    zone: str | None = ZONE
    mode: str = "cluster"


def ip(n: int) -> str:
    return f"198.18.1.{n}"


def hp(n: int) -> str:
    return f"198.18.1.{n}:8080"


LOCAL_NODEPORT = {"type": "NodePort", "externalTrafficPolicy": "Local"}
NODEPORT_PORTS = ({"name": "http", "port": 80, "nodePort": 30080},)

CASES = [
    # --- conditions and defaults --------------------------------------------------------
    Case("ready and not ready", [ep(ip(1)), ep(ip(2), ready=False)], [hp(1)]),
    Case("nil conditions mean ready", [ep(ip(1), ready=None)], [hp(1)]),
    Case("serving nil follows ready=false", [ep(ip(1), ready=False, terminating=True)], []),
    Case(
        "terminating not used while something is ready",
        [ep(ip(1)), ep(ip(2), ready=False, serving=True, terminating=True)],
        [hp(1)],
    ),
    Case(
        "cluster falls back to serving+terminating when nothing is ready",
        [
            ep(ip(1), ready=False, serving=True, terminating=True),
            ep(ip(2), ready=False, serving=False, terminating=True),
            ep(ip(3), ready=False),
        ],
        [hp(1)],
    ),
    Case("no endpoints at all", [], []),
    # --- traffic policy Local ----------------------------------------------------------
    Case(
        "internalTrafficPolicy Local uses only this node",
        [ep(ip(1), node=NODE), ep(ip(2), node="node-b")],
        [],
        local=[hp(1)],
        spec={"internalTrafficPolicy": "Local"},
    ),
    Case(
        "internal Local with no local endpoint: empty (dropped), not sent elsewhere",
        [ep(ip(2), node="node-b")],
        [],
        local=[],
        spec={"internalTrafficPolicy": "Local"},
    ),
    Case(
        "local falls back to serving+terminating on this node",
        [
            ep(ip(1), node=NODE, ready=False, serving=True, terminating=True),
            ep(ip(2), node="node-b"),
        ],
        [],
        local=[hp(1)],
        spec={"internalTrafficPolicy": "Local"},
    ),
    Case(
        "local prefers ready over terminating on this node",
        [
            ep(ip(1), node=NODE, ready=False, serving=True, terminating=True),
            ep(ip(3), node=NODE),
        ],
        [],
        local=[hp(3)],
        spec={"internalTrafficPolicy": "Local"},
    ),
    Case(
        "externalTrafficPolicy Local on a NodePort: cluster set for internal, local for external",
        [ep(ip(1), node=NODE), ep(ip(2), node="node-b")],
        [hp(1), hp(2)],
        local=[hp(1)],
        spec=LOCAL_NODEPORT,
    ),
    Case(
        "externalTrafficPolicy Local without external access is ignored",
        [ep(ip(1), node=NODE), ep(ip(2), node="node-b")],
        [hp(1), hp(2)],
        local=[],
        spec={"externalTrafficPolicy": "Local"},
    ),
    # --- hints (upstream) ------------------------------------------------------------------
    Case(
        "zone hints used when every ready endpoint has one",
        [ep(ip(1), zones=(ZONE,)), ep(ip(2), zones=("zone-b",)), ep(ip(3), zones=(ZONE,))],
        [hp(1), hp(3)],
        mode="hints-zone",
    ),
    Case(
        "zone hints ignored when one ready endpoint is unhinted",
        [ep(ip(1), zones=(ZONE,)), ep(ip(2))],
        [hp(1), hp(2)],
    ),
    Case(
        "unhinted not-ready endpoints do not disable hints",
        [ep(ip(1), zones=(ZONE,)), ep(ip(2), zones=("zone-b",)), ep(ip(3), ready=False)],
        [hp(1)],
        mode="hints-zone",
    ),
    Case(
        "zone hints for other zones only: ignored",
        [ep(ip(1), zones=("zone-b",)), ep(ip(2), zones=("zone-c",))],
        [hp(1), hp(2)],
    ),
    Case(
        "node missing its zone label: zone hints ignored",
        [ep(ip(1), zones=(ZONE,)), ep(ip(2), zones=("zone-b",))],
        [hp(1), hp(2)],
        zone=None,
    ),
    Case(
        "node hints before zone hints",
        [
            ep(ip(1), nodes=(NODE,), zones=(ZONE,)),
            ep(ip(2), nodes=("node-b",), zones=(ZONE,)),
            ep(ip(3), nodes=("node-c",), zones=("zone-b",)),
        ],
        [hp(1)],
        mode="hints-node",
    ),
    Case(
        "node hints not naming this node fall back to zone hints",
        [
            ep(ip(1), nodes=("node-b",), zones=(ZONE,)),
            ep(ip(2), nodes=("node-c",), zones=("zone-b",)),
        ],
        [hp(1)],
        mode="hints-zone",
    ),
    Case(
        "hints do not narrow the serving+terminating fallback",
        [
            ep(ip(1), ready=False, serving=True, terminating=True, zones=("zone-b",)),
            ep(ip(2), ready=False, serving=True, terminating=True, zones=(ZONE,)),
        ],
        [hp(1), hp(2)],
    ),
    # --- trafficDistribution without hints (ours) ------------------------------------------
    Case(
        "PreferSameZone from the endpoints' zones",
        [ep(ip(1), zone=ZONE), ep(ip(2), zone="zone-b")],
        [hp(1)],
        spec={"trafficDistribution": "PreferSameZone"},
        mode="prefer-zone",
    ),
    Case(
        "PreferClose is PreferSameZone",
        [ep(ip(1), zone=ZONE), ep(ip(2), zone="zone-b")],
        [hp(1)],
        spec={"trafficDistribution": "PreferClose"},
        mode="prefer-zone",
    ),
    Case(
        "PreferSameZone with nothing in this zone: whole cluster",
        [ep(ip(1), zone="zone-b"), ep(ip(2), zone="zone-c")],
        [hp(1), hp(2)],
        spec={"trafficDistribution": "PreferSameZone"},
    ),
    Case(
        "PreferSameNode on this node",
        [ep(ip(1), node=NODE, zone=ZONE), ep(ip(2), node="node-b", zone=ZONE)],
        [hp(1)],
        spec={"trafficDistribution": "PreferSameNode"},
        mode="prefer-node",
    ),
    Case(
        "PreferSameNode with no endpoint on this node: this zone, then the cluster",
        [ep(ip(1), node="node-b", zone=ZONE), ep(ip(2), node="node-c", zone="zone-b")],
        [hp(1)],
        spec={"trafficDistribution": "PreferSameNode"},
        mode="prefer-zone",
    ),
    Case(
        "PreferSameNode, nothing on this node or zone: whole cluster",
        [ep(ip(1), node="node-b", zone="zone-b"), ep(ip(2), node="node-c", zone="zone-c")],
        [hp(1), hp(2)],
        spec={"trafficDistribution": "PreferSameNode"},
    ),
    Case(
        "hints take precedence over trafficDistribution from the spec",
        [ep(ip(1), zone="zone-b", zones=(ZONE,)), ep(ip(2), zone=ZONE, zones=("zone-b",))],
        [hp(1)],
        spec={"trafficDistribution": "PreferSameZone"},
        mode="hints-zone",
    ),
    Case(
        "a preferred endpoint that is not ready does not count",
        [ep(ip(1), zone=ZONE, ready=False), ep(ip(2), zone="zone-b")],
        [hp(2)],
        spec={"trafficDistribution": "PreferSameZone"},
    ),
    # --- sliceproxy.io/topology-preference (ours) -------------------------------------------
    Case(
        "preference: node first",
        [ep(ip(1), node=NODE, zone=ZONE), ep(ip(2), node="node-b", zone=ZONE)],
        [hp(1)],
        annotations={PREF: "kubernetes.io/hostname,topology.kubernetes.io/zone,*"},
        mode="prefer-node",
    ),
    Case(
        "preference: zone when nothing on this node",
        [ep(ip(1), node="node-b", zone=ZONE), ep(ip(2), node="node-c", zone="zone-b")],
        [hp(1)],
        annotations={PREF: "kubernetes.io/hostname, topology.kubernetes.io/zone, *"},
        mode="prefer-zone",
    ),
    Case(
        "preference: * means any",
        [ep(ip(1), node="node-b", zone="zone-b"), ep(ip(2), node="node-c", zone="zone-c")],
        [hp(1), hp(2)],
        annotations={PREF: "kubernetes.io/hostname,*"},
    ),
    Case(
        "preference without *: still falls back to the cluster, never drops",
        [ep(ip(1), node="node-b", zone="zone-b")],
        [hp(1)],
        annotations={PREF: "kubernetes.io/hostname"},
    ),
    Case(
        "preference overrides hints",
        [ep(ip(1), node=NODE, zones=("zone-b",)), ep(ip(2), node="node-b", zones=(ZONE,))],
        [hp(1)],
        annotations={PREF: "kubernetes.io/hostname,*"},
        mode="prefer-node",
    ),
    Case(
        "preference: unknown key ignored, node without zone label skips the zone key",
        [ep(ip(1), node="node-b", zone=ZONE), ep(ip(2), node="node-c", zone="zone-b")],
        [hp(1), hp(2)],
        annotations={PREF: "topology.kubernetes.io/region,topology.kubernetes.io/zone"},
        zone=None,
    ),
    Case(
        "preference narrows the cluster set only; Local keeps its own set",
        [
            ep(ip(1), node=NODE, zone=ZONE),
            ep(ip(2), node="node-b", zone=ZONE),
            ep(ip(3), node="node-c", zone="zone-b"),
        ],
        [hp(1), hp(2)],
        local=[hp(1)],
        annotations={PREF: "topology.kubernetes.io/zone"},
        spec={**LOCAL_NODEPORT},
        zone=ZONE,
        mode="prefer-zone",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_selection(case: Case) -> None:
    nodeport = case.spec.get("type") == "NodePort"
    ports = NODEPORT_PORTS if nodeport else ({"name": "http", "port": 80},)
    rsp = resolve_one(
        node(zone=case.zone),
        service(annotations=case.annotations, ports=ports, **case.spec),
        eps_slice("s1", case.endpoints),
    )
    assert addrs(rsp.cluster_endpoints) == sorted(case.cluster)
    assert addrs(rsp.local_endpoints) == sorted(case.local)
    assert rsp.topology.mode == case.mode, rsp.topology


def test_every_endpoint_says_why() -> None:
    rsp = resolve_one(
        node(),
        service(trafficDistribution="PreferSameZone"),
        eps_slice("s1", [
            ep(ip(1), zone=ZONE),
            ep(ip(2), zone="zone-b"),
            ep(ip(3), ready=False, serving=True, terminating=True),
            ep(ip(4), ready=False),
        ]),
    )
    reasons = {str(s.endpoint): s.reason for s in rsp.endpoints}
    assert reasons[hp(1)] == "cluster: ready, in this zone (zone-a)"
    assert reasons[hp(2)].startswith("cluster: ready, but outside the preferred topology")
    assert reasons[hp(3)] == "cluster: terminating (ready endpoints exist)"
    assert reasons[hp(4)] == "cluster: not ready, not serving"
    assert "zone zone-a" in rsp.topology.reason


def test_hints_ignored_reason_names_the_zone() -> None:
    rsp = resolve_one(
        node(),
        service(),
        eps_slice("s1", [ep(ip(1), zones=("zone-b",))]),
    )
    assert rsp.topology.mode == "cluster"
    assert rsp.topology.reason == "hints ignored: no endpoint is hinted for zone zone-a"


def test_local_policy_reason_for_remote_endpoint() -> None:
    rsp = resolve_one(
        node(),
        service(internalTrafficPolicy="Local"),
        eps_slice("s1", [ep(ip(2), node="node-b")]),
    )
    assert not rsp.uses_cluster and rsp.uses_local
    assert rsp.endpoints[0].reason == "local: not on this node"
    assert rsp.has_any_endpoints  # usable elsewhere, so Local drops rather than rejects
