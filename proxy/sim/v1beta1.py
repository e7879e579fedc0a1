"""EndpointSlices as a v1.20 API server keeps them: discovery.k8s.io/v1beta1.

In 1.20 an endpoint says where it runs only through its `topology` map
(`kubernetes.io/hostname`, `topology.kubernetes.io/zone`); `nodeName` and the
`serving`/`terminating` conditions sat behind alpha feature gates that were off by
default, so the server dropped them on write, and `zone`/`hints` did not exist yet (a
1.20 server drops unknown fields silently). `prepare` does that dropping; `from_v1`
converts a v1 manifest for `--api-level 1.20 -f ...`, the way `kubectl convert` would.
"""

from __future__ import annotations

from typing import Any

LABEL_HOSTNAME = "kubernetes.io/hostname"
LABEL_ZONE = "topology.kubernetes.io/zone"
API_VERSION = "discovery.k8s.io/v1beta1"

# Endpoint fields a default 1.20 server keeps; conditions it keeps.
_ENDPOINT_FIELDS = ("addresses", "conditions", "hostname", "targetRef", "topology")
_CONDITIONS = ("ready",)


def prepare(obj: dict[str, Any]) -> None:
    """Drop, in place, what a default v1.20 server would not store."""
    endpoints = obj.get("endpoints")
    if not isinstance(endpoints, list):
        return
    for i, ep in enumerate(endpoints):
        if not isinstance(ep, dict):
            continue
        kept = {k: v for k, v in ep.items() if k in _ENDPOINT_FIELDS}
        cond = kept.get("conditions")
        if isinstance(cond, dict):
            kept["conditions"] = {k: v for k, v in cond.items() if k in _CONDITIONS}
        endpoints[i] = kept


def from_v1(obj: dict[str, Any]) -> dict[str, Any]:
    """A discovery.k8s.io/v1 slice as v1beta1: nodeName and zone move into `topology`."""
    out = dict(obj)
    out["apiVersion"] = API_VERSION
    endpoints = []
    for ep in obj.get("endpoints") or []:
        if not isinstance(ep, dict):
            endpoints.append(ep)
            continue
        new = dict(ep)
        topology = dict(new.pop("deprecatedTopology", None) or {})
        node, zone = new.pop("nodeName", None), new.pop("zone", None)
        if node:
            topology[LABEL_HOSTNAME] = node
        if zone:
            topology[LABEL_ZONE] = zone
        if topology:
            new["topology"] = topology
        endpoints.append(new)
    if "endpoints" in obj:
        out["endpoints"] = endpoints
    return out
