"""The JSON shape of a resolved service port: `python -m proxy explain` prints it and the
agent's `/debug/dump` serves it. It is a stable contract (documented in docs/explain.md):
add fields freely, never rename or remove one.
"""

from __future__ import annotations

from typing import Any

from proxy.model.nodeport_addresses import listen_view, primary_ips
from proxy.model.selection import NodeView, routes
from proxy.model.snapshot import EndpointSet, ResolvedServicePort, SelectedEndpoint
from proxy.model.types import IPNetwork, Node, format_endpoint


def service_port_view(rsp: ResolvedServicePort) -> dict[str, Any]:
    svc, port = rsp.service, rsp.port
    return {
        "service": rsp.key.service,
        "port": port.name,
        "family": rsp.key.family.label,
        "protocol": port.protocol.value,
        "port_number": port.port,
        "node_port": port.node_port or None,
        "cluster_ips": [str(ip) for ip in rsp.cluster_ips],
        "external_ips": [str(ip) for ip in svc.external_ips if ip.version == rsp.key.family],
        "load_balancer_ips": [
            str(ip) for ip in svc.load_balancer_ips if ip.version == rsp.key.family
        ],
        "session_affinity_seconds": svc.affinity_timeout,
        # random, maglev or source-hash: the annotation's, else --default-balancing.
        "balancing": rsp.balancing.value,
        # The service's sliceproxy.io/fail-fast and traffic-per-endpoint annotations;
        # null: the node's --fail-fast, --traffic-per-endpoint (the dump's `config`).
        "fail_fast": svc.fail_fast,
        "traffic_per_endpoint": svc.traffic_per_endpoint,
        "policies": {
            "internal": svc.internal_traffic_policy.value,
            "external": svc.external_traffic_policy.value,
            "uses_cluster_set": rsp.uses_cluster,
            "uses_local_set": rsp.uses_local,
            # Which set each kind of traffic uses ("cluster", "local"; null: none such).
            "sets": _sets(rsp),
        },
        "cluster_endpoints": sorted(str(ep) for ep in rsp.cluster_endpoints),
        "local_endpoints": sorted(str(ep) for ep in rsp.local_endpoints),
        "topology": {
            "mode": rsp.topology.mode,
            "requested": rsp.topology.requested,
            "reason": rsp.topology.reason,
        },
        "conflicts": [
            {
                "endpoint": c.endpoint,
                "slices": list(c.slices),
                "fields": list(c.fields),
                "chosen": c.chosen,
            }
            for c in rsp.conflicts
        ],
        "endpoints": [_endpoint_view(s) for s in rsp.endpoints],
    }


def _sets(rsp: ResolvedServicePort) -> dict[str, str | None]:
    r = routes(rsp.service, rsp.port, rsp.key.family)
    return {
        "cluster_ip": r.cluster_ip.value,
        "external": r.external.value if r.external else None,
        "external_from_pods_and_node": (r.external_from_inside.value
                                        if r.external_from_inside else None),
    }


def _endpoint_view(sel: SelectedEndpoint) -> dict[str, Any]:
    ep = sel.endpoint
    return {
        "endpoint": format_endpoint(ep.address, ep.port),
        "ready": ep.ready,
        "serving": ep.serving,
        "terminating": ep.terminating,
        "node": ep.node_name,
        "zone": ep.zone,
        "hints": {"zones": list(ep.zone_hints), "nodes": list(ep.node_hints)},
        "slices": list(ep.sources),
        "conflict": ep.conflict,
        "selected_for": [s.value for s in EndpointSet if s in sel.selected_for],
        "reason": sel.reason,
    }


def node_view(view: NodeView, node: Node | None,
              nodeports: tuple[tuple[IPNetwork, ...], bool] | None = None) -> dict[str, Any]:
    """The node as its Node object reads; with `nodeports` (--nodeport-addresses: its
    CIDRs, and whether `primary` was given), also where NodePorts listen."""
    primary = primary_ips(node.addresses) if node is not None else ()
    out: dict[str, Any] = {
        "name": view.name,
        "zone": view.zone,
        "labels": dict(node.labels) if node is not None else None,
        "addresses": [{"type": a.type, "address": str(a.address)} for a in node.addresses]
        if node is not None else None,
        "primary_ips": [str(ip) for ip in primary],
    }
    if nodeports is not None:
        out["nodeports"] = listen_view(*nodeports, primary)
    return out
